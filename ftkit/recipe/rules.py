"""Rules across recipe keys that the schema's per-field types cannot state: which ZeRO stage/offload combinations
DeepSpeed can run, and which keys belong to which sharding backend. The loader reports them to the user; the
planner's candidates obey them."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TypedDict

from ftkit.recipe.schema import DEEPSPEED_SCHEDULES, FIELD_BY_KEY, SECTION_BY_NAME, Value

# Each DeepSpeed-only key, and what to use under train.backend fsdp2 instead (the refusal's second half).
FSDP2_EQUIVALENT = {
    "zero.stage": "use fsdp.reshard_after_forward (true: ZeRO-3's memory, false: about ZeRO-2's)",
    "zero.offload_optimizer": "FSDP2 offloads parameters, gradients and optimizer states together: use "
    "fsdp.offload_params",
    "zero.offload_params": "use fsdp.offload_params",
    "zero.nvme_path": "FSDP2 has no NVMe offload: remove it",
    "zero.overlap_comm": "FSDP2 overlaps communication per wrapped layer: remove it",
    "zero.reduce_bucket_size": "FSDP2 reduce-scatters per wrapped layer: remove it",
    "zero.allgather_bucket_size": "FSDP2 all-gathers per wrapped layer: remove it",
    "zero.contiguous_gradients": "FSDP2 has no such setting: remove it",
    "zero.round_robin_gradients": "FSDP2 has no such setting: remove it",
    "zero.pin_memory": "FSDP2's CPU offload pins host memory itself: remove it",
    "zero.sub_group_size": "FSDP2 has no such setting: remove it",
    "zero.prefetch_bucket_size": "FSDP2 prefetches one wrapped layer ahead: remove it",
    "zero.param_persistence_threshold": "FSDP2 shards every wrapped layer: remove it",
    "zero.max_live_parameters": "FSDP2 keeps one wrapped layer gathered at a time: remove it",
    "zero.max_reuse_distance": "FSDP2 has no such setting: remove it",
}
FSDP_KEYS = tuple(f"fsdp.{name}" for name in SECTION_BY_NAME["fsdp"].names)
SCHEDULER_KEYS = tuple(f"scheduler.{name}" for name in SECTION_BY_NAME["scheduler"].names)
# The scheduler section's keys each DeepSpeed schedule reads (deepspeed/runtime/lr_schedules.py, 0.19)
SCHEDULER_PARAMS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_type", "warmup_min_lr"),
    "WarmupDecayLR": ("warmup_type", "warmup_min_lr"),
    "WarmupCosineLR": ("warmup_type", "warmup_min_ratio", "cos_min_ratio"),
    "OneCycle": (
        "cycle_min_lr",
        "cycle_max_lr",
        "decay_lr_rate",
        "cycle_first_step_size",
        "cycle_second_step_size",
        "cycle_first_stair_count",
        "cycle_second_stair_count",
        "decay_step_size",
        "cycle_momentum",
        "cycle_min_mom",
        "cycle_max_mom",
        "decay_mom_rate",
    ),
    "LRRangeTest": (
        "lr_range_test_min_lr",
        "lr_range_test_step_size",
        "lr_range_test_step_rate",
        "lr_range_test_staircase",
    ),
}


def backend_problems(values: Mapping[str, Value], explicit: Collection[str]) -> list[tuple[str, str]]:
    """``(recipe key, problem)`` for each key the chosen ``train.backend`` cannot use, each with what to use
    instead; ``explicit``: the keys the recipe file or command line set. A key set to its default is left alone (a
    full recipe, such as ``ftkit import`` writes, lists every key)."""
    out: list[tuple[str, str]] = []

    def changed(key: str) -> bool:
        return key in explicit and values[key] != FIELD_BY_KEY[key].default

    if values["train.backend"] == "deepspeed":
        for key in FSDP_KEYS:
            if changed(key):
                out.append((key, "applies to train.backend fsdp2 only (train.backend is deepspeed: see zero.*)"))
        return out
    auto = values["train.backend"] == "auto"  # zero.* narrow the ZeRO candidates, fsdp.* the FSDP2 ones
    for key, instead in FSDP2_EQUIVALENT.items():
        if changed(key) and not auto:
            out.append((key, f"DeepSpeed's key; under train.backend fsdp2 {instead}"))
    if values["fsdp.offload_params"] and values["cluster.accelerator"] == "cpu":
        out.append(("fsdp.offload_params", "needs cuda: on cpu ranks the parameters are in host memory already"))
    if auto and values["cluster.engine"] not in ("accelerate", "auto") and "cluster.engine" in explicit:
        out.append(
            (
                "cluster.engine",
                f"train.backend auto may choose fsdp2, which ftkit launches under accelerate only (not "
                f"{values['cluster.engine']}): set cluster.engine accelerate (the default under auto), or choose "
                "train.backend",
            )
        )
    elif values["cluster.engine"] == "deepspeed" and "cluster.engine" in explicit:
        out.append(
            (
                "cluster.engine",
                "the deepspeed runner starts DeepSpeed ranks; ftkit launches train.backend fsdp2 under accelerate "
                "(the default without cluster.engine)",
            )
        )
    if "checkpoint.local_dir" in explicit and values["checkpoint.local_dir"] not in (None, "auto"):
        out.append(
            (
                "checkpoint.local_dir",
                "the node-local checkpoint tier knows DeepSpeed's checkpoints only: set it to null under "
                f"train.backend {values['train.backend']}",
            )
        )
    if values["checkpoint.peer_copies"]:
        out.append(("checkpoint.peer_copies", "copies the node-local tier, which fsdp2 does not use: set it to 0"))
    return out


def offload_problems(stage: int | str, offload_optimizer: str, offload_params: str) -> list[tuple[str, str]]:
    """The ZeRO stage/offload rules, stated once: ``(recipe key, problem)`` for each combination DeepSpeed cannot
    run. ``stage`` may be ``"auto"`` (the planner then only picks valid candidates). The recipe loader reports
    these to the user; :class:`Candidate` refuses them."""
    out = []
    if offload_params != "none" and stage not in (3, "auto"):
        out.append(
            (
                "zero.offload_params",
                f"parameter offload needs ZeRO stage 3 (zero.stage is {stage}); set zero.stage: 3 or "
                "offload_params: none",
            )
        )
    if offload_optimizer != "none" and stage == 0:
        out.append(("zero.offload_optimizer", "optimizer offload needs ZeRO stage 1 or higher (zero.stage is 0)"))
    if offload_optimizer == "nvme" and stage not in (3, "auto"):
        out.append(
            (
                "zero.offload_optimizer",
                f"nvme optimizer offload needs ZeRO stage 3 (zero.stage is {stage}); use cpu at stage 1/2",
            )
        )
    return out


def scheduler_problems(values: Mapping[str, Value], explicit: Collection[str]) -> list[tuple[str, str]]:
    """``(recipe key, problem)`` for DeepSpeed's own schedules: they live in ds_config.json, so they need
    ``train.backend: deepspeed``; OneCycle needs both its learning rates; a ``scheduler.*`` key the schedule does not
    read is refused (a key set to its default is left alone, as a full recipe such as ``ftkit import`` writes lists
    every key)."""
    out: list[tuple[str, str]] = []
    schedule = str(values["train.lr_scheduler"])
    deepspeed = schedule in DEEPSPEED_SCHEDULES
    if deepspeed and values["train.backend"] != "deepspeed":
        out.append(
            (
                "train.lr_scheduler",
                f"DeepSpeed's {schedule} is rendered into ds_config.json: it needs train.backend deepspeed (is "
                f"{values['train.backend']}); use linear, cosine, constant or constant_with_warmup",
            )
        )
    read = SCHEDULER_PARAMS.get(schedule, ())
    for key in SCHEDULER_KEYS:
        name = key.removeprefix("scheduler.")
        if key in explicit and values[key] != FIELD_BY_KEY[key].default and name not in read:
            used = ", ".join(s for s, names in SCHEDULER_PARAMS.items() if name in names)
            out.append((key, f"applies to train.lr_scheduler {used} only (train.lr_scheduler is {schedule})"))
    if schedule == "OneCycle":
        for key in ("scheduler.cycle_min_lr", "scheduler.cycle_max_lr"):
            if values[key] is None:
                out.append((key, "required with train.lr_scheduler OneCycle (DeepSpeed has no default for it)"))
    return out


def parallel_problems(values: Mapping[str, Value]) -> list[tuple[str, str]]:
    """``(recipe key, problem)`` for each tensor/sequence-parallel layout the engines cannot run, found from the
    recipe alone (the model's heads and the hosts' slots are checked by the plan, :func:`layout_problems`). ``auto``
    degrees are left to the planner, which only picks valid layouts."""
    out: list[tuple[str, str]] = []
    tp, sp, backend = values["parallel.tp"], values["parallel.sp"], values["train.backend"]
    tp_n = tp if isinstance(tp, int) else 1
    sp_n = sp if isinstance(sp, int) else 1
    if tp_n > 1 and sp_n > 1:
        out.append(
            (
                "parallel.sp",
                f"tensor and sequence parallelism together (tp {tp_n} x sp {sp_n}) are not supported: Accelerate "
                "prepares DeepSpeed with AutoTP or with Ulysses, not both, and FSDP2 has no Ulysses SP; set "
                "parallel.tp or parallel.sp to 1",
            )
        )
    if sp_n > 1 and backend != "deepspeed":
        out.append(
            (
                "parallel.sp",
                f"Ulysses sequence parallelism is DeepSpeed's (ALST, Accelerate sp_backend deepspeed): it needs "
                f"train.backend deepspeed (is {backend}); or set parallel.sp: 1",
            )
        )
    if tp_n > 1 and backend == "auto":
        out.append(
            (
                "parallel.tp",
                "tensor parallelism runs differently on each backend (deepspeed: AutoTP with ZeRO 0-2; fsdp2: tp "
                "x FSDP2 sharding): set train.backend deepspeed or fsdp2",
            )
        )
    if tp_n > 1 and backend == "deepspeed" and values["zero.stage"] == 3:
        out.append(
            (
                "parallel.tp",
                "DeepSpeed AutoTP training under HF Trainer runs at ZeRO stage 0-2 (zero.stage is 3: the weights "
                "are partitioned at load, before AutoTP splits them); set zero.stage 2, or train.backend fsdp2",
            )
        )
    group = tp_n * sp_n
    per_node = values["cluster.gpus_per_node"]
    if group > 1 and values["cluster.hostfile"] is None and isinstance(per_node, int) and per_node % group:
        key = "parallel.tp" if tp_n > 1 else "parallel.sp"
        out.append(
            (
                key,
                f"{_group(tp_n, sp_n)} does not divide cluster.gpus_per_node {per_node}: a tensor- or "
                "sequence-parallel group stays inside one node, on its fast links; use a divisor of "
                f"{per_node}",
            )
        )
    seq = values["data.max_seq_len"]
    if sp_n > 1 and isinstance(seq, int) and seq % sp_n:
        out.append(
            (
                "parallel.sp",
                f"{sp_n} does not divide data.max_seq_len {seq}: Ulysses splits every sequence into {sp_n} equal "
                f"parts; use a max_seq_len that is a multiple of {sp_n} (e.g. {seq + sp_n - seq % sp_n})",
            )
        )
    return out


class LayoutFacts(TypedDict):
    """What :func:`layout_problems` needs besides the degrees (:func:`ftkit.plan.parallel.layout_facts`)."""

    backend: str
    slots: list[int]
    heads: int | None
    kv_heads: int | None
    attn_implementation: str


def layout_problems(
    tp: int,
    sp: int,
    *,
    backend: str,
    slots: list[int],
    heads: int | None,
    kv_heads: int | None,
    attn_implementation: str,
) -> list[tuple[str, str]]:
    """``(recipe key, problem)`` for a concrete ``tp`` x ``sp`` layout against the hosts' ``slots`` (processes per
    host, in rank order) and the model's heads: the rules that need the hostfile and config.json. The plan reports
    them for the recipe's degrees; ``auto`` keeps only the layouts with none."""
    out: list[tuple[str, str]] = []
    group, world = tp * sp, sum(slots)
    key = "parallel.tp" if tp > 1 else "parallel.sp"
    if group == 1:
        return out
    uneven = [n for n in slots if n % group]
    if uneven:
        out.append(
            (
                key,
                f"{_group(tp, sp)} does not divide the {uneven[0]} processes of a host: a tensor- or sequence-parallel "
                "group stays inside one node; use a divisor of every host's slots",
            )
        )
    if tp > 1 and backend == "fsdp2" and tp == world:
        out.append(
            (
                "parallel.tp",
                f"{tp} leaves FSDP2 no ranks to shard over (world size {world}; Accelerate refuses dp_shard_size 1 "
                "under FSDP): use a tp below the world size, or train.backend deepspeed (AutoTP)",
            )
        )
    if tp > 1 and heads is not None and heads % tp:
        out.append(("parallel.tp", f"{tp} does not divide the model's {heads} attention heads; use a divisor of it"))
    if tp > 1 and kv_heads is not None and kv_heads % tp:
        out.append(("parallel.tp", f"{tp} does not divide the model's {kv_heads} key-value heads; use a divisor of it"))
    if sp > 1 and heads is not None and heads % sp:
        out.append(
            (
                "parallel.sp",
                f"{sp} does not divide the model's {heads} attention heads (Ulysses gives each rank whole heads); "
                "use a divisor of it",
            )
        )
    if sp > 1 and kv_heads is not None and kv_heads % sp and sp % kv_heads:
        out.append(
            (
                "parallel.sp",
                f"{sp} and the model's {kv_heads} key-value heads do not divide one another (DeepSpeed's Ulysses "
                "needs one to divide the other)",
            )
        )
    if sp > 1 and attn_implementation == "eager":
        out.append(
            (
                "parallel.sp",
                "Ulysses sequence parallelism cannot use eager attention (config.json attn_implementation: eager; "
                "it passes position_ids, not an attention mask): use sdpa or flash_attention_2",
            )
        )
    return out


def _group(tp: int, sp: int) -> str:
    """The group's size as the recipe spells it: ``tp 4``, ``sp 2``, or ``tp 2 x sp 2 = 4``."""
    if tp > 1 and sp > 1:
        return f"tp {tp} x sp {sp} = {tp * sp}"
    return f"tp {tp}" if tp > 1 else f"sp {sp}"
