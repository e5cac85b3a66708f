"""FSDP sources -> ``train.backend: fsdp2``, in one place: Accelerate's ``distributed_type: FSDP`` with its
``fsdp_config`` (also LLaMA-Factory's ``examples/accelerate/fsdp*.yaml``, which are Accelerate configs), Axolotl's
``fsdp_config``/``fsdp_version`` and TrainingArguments' ``fsdp``/``fsdp_config``.

FSDP2 configs map key for key. FSDP1 configs are imported as FSDP2, the way ``accelerate to-fsdp2`` converts them
(accelerate/commands/to_fsdp2.py: ``fsdp_sharding_strategy`` becomes ``fsdp_reshard_after_forward``; backward
prefetch, ``sync_module_states`` and ``use_orig_params`` are removed; forward prefetch is not implemented), with one
report line per key whose meaning changes. What FSDP2 cannot do is refused with the reason (a local state dict,
which Accelerate's FSDP2 plugin refuses). Keys are read with or without their ``fsdp_`` prefix (Accelerate writes
it, Axolotl and TrainingArguments do not). :func:`canonical` puts a file's ``fsdp_config`` in the same terms for
``ftkit check --against``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ftkit.imports.mapping import HARD, MAPPED, NO_EFFECT, REFUSED, Report, Sink, fmt
from ftkit.imports.values import to_bool, unset
from ftkit.recipe.schema import Value

# accelerate/utils/constants.py: the strategies by name, or by number (their index + 1, as Accelerate accepts them)
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# accelerate to-fsdp2's ARGUMENT_VALUE_MAPPING: each FSDP1 strategy as FSDP2's reshard_after_forward
RESHARD = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
    "NO_SHARD": False,
}
# what changes when the strategy becomes reshard_after_forward (none for FULL_SHARD and SHARD_GRAD_OP)
_STRATEGY_CHANGE = {
    "HYBRID_SHARD": "FSDP1 shards within each node and replicates across nodes (HSDP); ftkit's FSDP2 shards "
    "across every rank",
    "HYBRID_SHARD_ZERO2": "FSDP1 shards within each node and replicates across nodes (HSDP); ftkit's FSDP2 shards "
    "across every rank",
    "NO_SHARD": "FSDP1 keeps every parameter whole on every rank (DDP); FSDP2 shards them, gathered from forward to "
    "backward (ZeRO-2's memory)",
}
_SAME = "same update; other memory and communication"
STATE_DICTS = {"SHARDED_STATE_DICT": "sharded", "FULL_STATE_DICT": "full"}
WRAP = "TRANSFORMER_BASED_WRAP"
NONE = "no effect on training"


def fsdp_version(value: object) -> int:
    """The FSDP version a config asks for: ``fsdp_version: 2`` (Accelerate, Axolotl; ``version`` in
    TrainingArguments' fsdp_config), else 1."""
    if isinstance(value, dict):
        v = value.get("fsdp_version", value.get("version", 1))
        return 2 if str(v).strip() == "2" else 1
    return 1


def _name(key: str) -> str:
    return key.removeprefix("fsdp_")


def read(
    sink: Sink,
    prefix: str,
    block: Mapping[str, object],
    version: int,
    defaults: Mapping[str, Value],
) -> None:
    """Claims for every key of an FSDP block (keys with or without ``fsdp_``), then for the keys it leaves out whose
    default (``defaults``, by unprefixed name: what the tool that reads the block fills in) differs from ftkit's."""
    v1 = version == 1
    policy = str(block.get("fsdp_auto_wrap_policy", block.get("auto_wrap_policy", defaults.get("auto_wrap_policy"))))
    for raw, value in block.items():
        key = f"{prefix}.{raw}" if prefix else str(raw)
        name = _name(str(raw))
        if name == "version":
            if str(value).strip() in ("1", "2"):
                sink.same(key, "FSDP2" if not v1 else "FSDP1: imported as FSDP2, converted like accelerate to-fsdp2")
            else:
                sink.problem(key, f"must be 1 or 2; got {fmt(value)}")
        elif name in ("sharding_strategy", "reshard_after_forward"):
            _strategy(sink, key, name, value, v1)
        elif name == "offload_params":
            if (b := to_bool(sink, key, value)) is not None:
                sink.map(key, "fsdp.offload_params", b)
        elif name == "cpu_ram_efficient_loading":
            if (b := to_bool(sink, key, value)) is not None:
                sink.map(key, "fsdp.cpu_ram_efficient_loading", b)
        elif name == "activation_checkpointing":
            if (b := to_bool(sink, key, value)) is not None:
                sink.map(key, "model.gradient_checkpointing", b, "FSDP's activation checkpointing per wrapped layer")
        elif name == "state_dict_type":
            _state_dict(sink, key, value)
        elif name == "auto_wrap_policy":
            _policy(sink, key, value)
        elif name == "transformer_layer_cls_to_wrap":
            _layer_cls(sink, key, value, policy)
        elif name == "min_num_params":
            why = "the size of each FSDP unit under SIZE_BASED_WRAP; ftkit wraps each decoder layer"
            sink.no_effect(key, why if policy.upper() == "SIZE_BASED_WRAP" else "used only by SIZE_BASED_WRAP", _SAME)
        elif name == "backward_prefetch":
            sink.no_effect(key, f"{fmt(value)}: removed in FSDP2 (accelerate to-fsdp2 drops it), which prefetches the "
                           "next unit's all-gather in backward itself", "speed only; same update")  # fmt: skip
        elif name == "forward_prefetch":
            if to_bool(sink, key, value) is False:
                sink.same(key, "off (FSDP2 has no forward prefetch setting)")
            else:
                sink.no_effect(key, "not implemented in FSDP2 (accelerate to-fsdp2 drops it; Accelerate's FSDP2 "
                               "refuses it)", "speed only; same update")  # fmt: skip
        elif name == "use_orig_params":
            sink.no_effect(key, f"{fmt(value)}: removed in FSDP2, which always trains the original parameters "
                           "(DTensors)", "same update")  # fmt: skip
        elif name == "sync_module_states":
            sink.no_effect(key, f"{fmt(value)}: removed in FSDP2 (not needed: with cpu_ram_efficient_loading rank 0's "
                           "weights reach the others)", NONE)  # fmt: skip
        elif name == "limit_all_gathers":
            sink.no_effect(key, "FSDP1's all-gather rate limiter; FSDP2 has none", "speed and memory only; same update")
        elif name == "activation_checkpointing_offload":
            if to_bool(sink, key, value) is False:
                sink.same(key, "off")
            else:
                sink.no_effect(key, "checkpointed activations offloaded to host memory: not supported by ftkit",
                               "same update; more device memory")  # fmt: skip
        elif name in ("ignored_modules", "ignored_params"):
            if unset(value):
                sink.same(key, "none")
            else:
                sink.no_effect(key, f"modules left unsharded ({fmt(value)}): ftkit shards every parameter", _SAME)
        elif name in ("final_state_dict_type", "save_policy"):
            sink.no_effect(key, "the final model's format: ftkit always saves it whole, in Hugging Face format", NONE)
        elif name in ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings"):
            if unset(value) or value is False:
                sink.same(key, "no XLA")
            else:
                sink.hard(key, "FSDP on XLA/TPU: ftkit runs on CUDA GPUs or CPUs")
        else:
            sink.unknown(key, value, "FSDP")
    _absent(sink, prefix, [str(k) for k in block], version, defaults)
    loading = block.get("fsdp_cpu_ram_efficient_loading", block.get("cpu_ram_efficient_loading"))
    sync = block.get("fsdp_sync_module_states", block.get("sync_module_states"))
    if defaults.get("launcher") and str(loading).lower() == "true" and str(sync).lower() == "false":
        sink.problem(
            f"{prefix}.fsdp_sync_module_states" if prefix else "fsdp_sync_module_states",
            "false with cpu_ram_efficient_loading true: accelerate launch refuses that (set it true)",
        )


def _strategy(sink: Sink, key: str, name: str, value: object, v1: bool) -> None:
    """FSDP1's sharding_strategy (or a strategy name in reshard_after_forward, as FSDP1 configs may write it) as
    FSDP2's reshard_after_forward; FSDP2's boolean as it is."""
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        if (b := to_bool(sink, key, value)) is not None:
            sink.map(key, "fsdp.reshard_after_forward", b)
        return
    strategy = str(value).strip().upper()
    if strategy.isdigit() and 1 <= int(strategy) <= len(SHARDING_STRATEGIES):
        strategy = SHARDING_STRATEGIES[int(strategy) - 1]
    if strategy not in RESHARD:
        sink.problem(key, f"must be one of {', '.join(SHARDING_STRATEGIES)}; got {fmt(value)}")
        return
    reshard = RESHARD[strategy]
    how = f"FSDP1's {strategy}: FSDP2's reshard_after_forward {fmt(reshard)}, as accelerate to-fsdp2 converts it"
    change = _STRATEGY_CHANGE.get(strategy)
    if change:
        how += f"; its meaning changes: {change}: {_SAME}"
    elif not v1 and name == "sharding_strategy":
        how += "; Accelerate reads it only for FSDP1"
    sink.map(key, "fsdp.reshard_after_forward", reshard, how)


def _state_dict(sink: Sink, key: str, value: object) -> None:
    text = str(value).strip().upper()
    if text in ("1", "2", "3"):  # StateDictType's numbers: FULL 1, LOCAL 2, SHARDED 3
        text = {"1": "FULL_STATE_DICT", "2": "LOCAL_STATE_DICT", "3": "SHARDED_STATE_DICT"}[text]
    if text in STATE_DICTS:
        sink.map(key, "fsdp.state_dict_type", STATE_DICTS[text])
    elif text == "LOCAL_STATE_DICT":
        c = sink.refuse(
            key,
            "LOCAL_STATE_DICT: FSDP2 has no local state dict (Accelerate's FSDP2 plugin accepts SHARDED_STATE_DICT "
            "and FULL_STATE_DICT only)",
            "accepted: sharded checkpoints (each rank's shards, which also resume on another world size)",
        )
        c.target, c.value = "fsdp.state_dict_type", "sharded"
    else:
        sink.problem(key, f"must be SHARDED_STATE_DICT, FULL_STATE_DICT or LOCAL_STATE_DICT; got {fmt(value)}")


def _policy(sink: Sink, key: str, value: object) -> None:
    policy = str(value).strip().upper()
    if policy == WRAP:
        sink.same(key, "one FSDP unit per decoder layer, as ftkit wraps")
    elif policy == "SIZE_BASED_WRAP":
        sink.no_effect(key, "units by parameter count (min_num_params); ftkit wraps each decoder layer", _SAME)
    elif policy in ("NO_WRAP", "NONE", ""):
        sink.no_effect(key, "the whole model one FSDP unit; ftkit wraps each decoder layer", _SAME)
    else:
        sink.problem(key, f"must be TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP; got {fmt(value)}")


def _layer_cls(sink: Sink, key: str, value: object, policy: str) -> None:
    if unset(value):
        sink.same(key, "unset: the model's _no_split_modules (ftkit's auto derives the same class)")
        return
    names = value if isinstance(value, list) else str(value).split(",")
    text = ",".join(str(n).strip() for n in names if str(n).strip())
    if policy.upper() not in (WRAP, "NONE"):
        sink.no_effect(key, f"used only by {WRAP} (the policy is {policy})", NONE)
    else:
        sink.map(key, "fsdp.transformer_layer_cls", text, "the layer class each FSDP unit wraps")


def _absent(sink: Sink, prefix: str, spelled: list[str], version: int, defaults: Mapping[str, Value]) -> None:
    """What a left-out key means where ftkit's default differs: the state dict (FSDP1: FULL_STATE_DICT), the wrap
    policy (NO_WRAP), RAM-efficient loading (off outside accelerate launch)."""
    given = {_name(k) for k in spelled}

    style = "" if given and not any(k.startswith("fsdp_") for k in spelled) else "fsdp_"  # as the block spells keys

    def where(name: str) -> str:
        return f"{prefix}.{style}{name}" if prefix else f"{style}{name}"

    if "state_dict_type" not in given and version == 1:
        sink.implied(where("state_dict_type"), "fsdp.state_dict_type", "full", "Accelerate's FSDP1 default "
                     "FULL_STATE_DICT")  # fmt: skip
    if "auto_wrap_policy" not in given and defaults.get("auto_wrap_policy") in (None, "NO_WRAP"):
        why = "Accelerate's default NO_WRAP: the whole model one FSDP unit; ftkit wraps each decoder layer"
        sink.no_effect(f"{where('auto_wrap_policy')} (absent)", why, _SAME)
    loading = defaults.get("cpu_ram_efficient_loading")
    if "cpu_ram_efficient_loading" not in given and loading is False:
        sink.implied(where("cpu_ram_efficient_loading"), "fsdp.cpu_ram_efficient_loading", False,
                     "off unless set (Accelerate's FullyShardedDataParallelPlugin)")  # fmt: skip


# What fills a key the block leaves out, by the tool that reads it.
ACCELERATE_LAUNCH: dict[str, Value] = {  # accelerate launch's argument defaults (accelerate/commands/launch.py)
    "launcher": True,
    "cpu_ram_efficient_loading": True,
    "auto_wrap_policy": None,
}
ENVIRONMENT: dict[str, Value] = {  # FSDP_* unset: the plugin's own defaults (Axolotl, TrainingArguments)
    "cpu_ram_efficient_loading": False,
    "auto_wrap_policy": None,
}


def backend(sink: Sink, key: str, version: int, how: str = "") -> None:
    """The claim that the source runs FSDP: train.backend fsdp2 under accelerate launch."""
    was = "FSDP2" if version == 2 else "FSDP1 (fsdp_version 1), imported as FSDP2: its keys converted like accelerate "
    was += "" if version == 2 else "to-fsdp2, each change of meaning on its own line"
    sink.map(key, "train.backend", "fsdp2", f"{was}{'; ' + how if how else ''}")
    sink.map(key, "cluster.engine", "accelerate", "ftkit launches FSDP2 under accelerate launch")


def options(sink: Sink, key: str, value: object, version: int) -> None:
    """TrainingArguments' (and older Axolotl's) ``fsdp`` options: ``"full_shard auto_wrap offload"`` or a list."""
    words = value if isinstance(value, list) else str(value).replace(",", " ").split()
    backend(sink, key, version)
    for word in (str(w).strip().lower() for w in words):
        if word.upper() in RESHARD:
            _strategy(sink, key, "sharding_strategy", word, version == 1)
        elif word == "offload":
            sink.map(key, "fsdp.offload_params", True, "offload: parameters, gradients, optimizer states on the host")
        elif word == "auto_wrap":
            sink.same(key, "auto_wrap: one FSDP unit per decoder layer, as ftkit wraps")
        else:
            sink.problem(key, f"unknown FSDP option {word!r} (full_shard, shard_grad_op, hybrid_shard, "
                         "hybrid_shard_zero2, no_shard, offload, auto_wrap)")  # fmt: skip


def canonical(
    block: Mapping[str, object], version: int, defaults: Mapping[str, Value] = ACCELERATE_LAUNCH
) -> tuple[dict[str, tuple[str, Value]], dict[str, str], dict[str, str]]:
    """A file's ``fsdp_config`` as ``ftkit import`` reads it, for ``check --against``: the recipe values it maps
    to (recipe key -> (source key, value)), the keys import does not carry because training does not change (key ->
    why) and the keys it refuses (key -> why)."""
    report = Report()
    read(report.sink("--against"), "", block, version, defaults)
    values: dict[str, tuple[str, Value]] = {}
    notes: dict[str, str] = {}
    refused: dict[str, str] = {}
    for c in report.claims:
        why = "; ".join(x for x in (c.how, c.effect) if x)
        if c.target is not None and c.status == MAPPED:
            values[c.target] = (c.key, c.value)
        elif c.status == NO_EFFECT:
            notes[c.key] = why
        elif c.status in (REFUSED, HARD):
            refused[c.key] = why
    return values, notes, refused
