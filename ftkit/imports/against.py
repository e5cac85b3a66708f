"""``ftkit check --against FILE``: a semantic diff between a hand-written config and what the recipe renders.

Both sides are put in DeepSpeed's canonical spelling first (:func:`ftkit.imports.deepspeed.canonical`: aliases,
deprecated names, ``2e8`` vs ``200000000``, ``"true"`` vs ``true``), a key one side leaves out takes DeepSpeed's
default, and keys DeepSpeed ignores in that config (stage-specific keys at another stage, fp16's loss scaling with
fp16 off) are left out. ``"auto"`` is resolved the way HF Trainer and Accelerate resolve it with the recipe's
TrainingArguments (the batch triple, clipping, optimizer values, precision) and the model's hidden size (bucket
sizes): equal after that is no difference; an ``"auto"`` nobody fills, or one that resolves to another value, is.
Settings that do not change training (DeepSpeed's logging and monitors, the untested-optimizer switches, saving
16-bit weights) are listed as notes, never as differences.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit.errors import Problem, UserError
from ftkit.imports import deepspeed, fsdp
from ftkit.imports.deepspeed import (
    DEFAULTS,
    SCHEDULE_PARAMS,
    canonical,
    canonical_key,
    default_clipping,
    relevant,
    schedule_name,
    stage_of,
)
from ftkit.imports.mapping import NO_EFFECT, Report, fmt
from ftkit.imports.read import load
from ftkit.render.accelerate import accelerate_dict
from ftkit.render.deepspeed import render_deepspeed

if TYPE_CHECKING:  # pragma: no cover
    from ftkit.plan.plan import Plan


class _Missing:
    """A key one side leaves out."""

    def __repr__(self) -> str:
        return "(absent)"


MISSING = _Missing()

HF_DERIVED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# keys that do not change training: reported as notes
NOT_TRAINING = {
    "steps_per_print": "DeepSpeed's progress print",
    "wall_clock_breakdown": "DeepSpeed's timing printout",
    "dump_state": "DeepSpeed's state printout",
    "memory_breakdown": "DeepSpeed's memory printout",
    "zero_allow_untested_optimizer": "ftkit configures DeepSpeed's own AdamW",
    "zero_force_ds_cpu_optimizer": "ftkit configures DeepSpeed's own AdamW",
    "optimizer.params.torch_adam": "the AdamW implementation (same update up to rounding)",
    "optimizer.params.fused": "the AdamW kernel (same update up to rounding)",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "saving only",
    "zero_optimization.ignore_unused_parameters": "an error check only",
}
NOT_TRAINING_PREFIXES = (
    "comms_logger.",
    "comms_config.",
    "monitor_config.",
    "tensorboard.",
    "wandb.",
    "csv_monitor.",
    "flops_profiler.",
    "timers.",
    "checkpoint.",
    "aio.",
    "autotuning.",
    "activation_checkpointing.",
    "compile.",
)


@dataclass(frozen=True)
class Difference:
    key: str
    file_value: object
    rendered_value: object
    kind: str  # "differs" | "only in file" | "only rendered" | "auto"
    note: str = ""

    def line(self, file: str) -> str:
        a, b = _show(self.file_value), _show(self.rendered_value)
        note = f" ({self.note})" if self.note else ""
        if self.kind == "only in file":
            return f"{file} {self.key}: only in {file} (= {a}); the recipe renders no such key{note}"
        if self.kind == "only rendered":
            return f"{file} {self.key}: not in {file}; the recipe renders {b}{note}"
        if self.kind == "auto":
            return f'{file} {self.key}: "auto" in {file}, the recipe renders {b}{note}'
        return f"{file} {self.key}: {a} in {file}, the recipe renders {b}{note}"


def _show(value: object) -> str:
    if value is MISSING:
        return "(absent)"
    if isinstance(value, str):
        return f'"{value}"'
    return fmt(value)


def diff_against(plan: Plan, file: str, ds_path_in_yaml: str = "ds_config.json") -> tuple[list[Difference], list[str]]:
    """(differences, notes) between ``file`` (a DeepSpeed JSON or an Accelerate YAML, whose deepspeed_config_file is
    compared too) and what ``plan`` renders."""

    loaded = load(file)
    if loaded.kind == "deepspeed":
        return compare_deepspeed(loaded.data, render_deepspeed(plan), plan)
    if loaded.kind != "accelerate":
        raise UserError(
            Problem(f"is a {loaded.kind} config: --against compares a DeepSpeed JSON or an Accelerate YAML", file=file)
        )
    data = loaded.mapping()
    rendered_ds = render_deepspeed(plan) if plan.recipe.train.backend == "deepspeed" else None
    diffs, notes = compare_accelerate(data, accelerate_dict(plan, ds_path_in_yaml), rendered_ds)
    plugin = data.get("deepspeed_config")
    ds = plugin.get("deepspeed_config_file") if isinstance(plugin, dict) else None
    if ds:
        path = Path(str(ds))
        if not path.is_absolute() and not path.exists():
            path = loaded.path.parent / path
        if not path.exists():
            raise UserError(Problem(f"deepspeed_config_file {ds}: not found", file=file))
        inner = load(str(path), kind="deepspeed")
        d2, n2 = compare_deepspeed(inner.data, render_deepspeed(plan), plan)
        diffs += [Difference(f"{ds}: {d.key}", d.file_value, d.rendered_value, d.kind, d.note) for d in d2]
        notes += [f"{ds}: {n}" for n in n2]
    return diffs, notes


def compare_deepspeed(
    file_cfg: object, rendered: Mapping[str, object], plan: Plan | None
) -> tuple[list[Difference], list[str]]:
    if not isinstance(file_cfg, dict):
        raise UserError(Problem("expected a DeepSpeed config (a JSON object)"))
    fa, fb = canonical(file_cfg), canonical(rendered)
    diffs: list[Difference] = []
    notes: list[str] = []
    not_carried = _not_carried(file_cfg)
    _schedule_defaults(fa)
    _schedule_defaults(fb)
    if plan is not None:
        for key in HF_DERIVED:  # absent: HF and DeepSpeed derive them from TrainingArguments, as for "auto"
            if key not in fa:
                fa[key] = "auto"
        if not any(k.startswith("optimizer.") for k in fa):  # HF builds AdamW from TrainingArguments
            fa.update({k: "auto" for k in ("optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps")})
            fa.update({"optimizer.type": "adamw", "optimizer.params.weight_decay": "auto"})
            notes.append('optimizer: absent: HF Trainer builds AdamW from TrainingArguments (compared as "auto")')
    if plan is not None and plan.tp * plan.sp > 1 and "train_batch_size" not in fb:
        was = fa.pop("train_batch_size", MISSING)
        if was is not MISSING:
            notes.append(
                f"train_batch_size: {_show(was)} not compared: under tensor/sequence parallelism ftkit leaves it to "
                "DeepSpeed (micro x accumulation x its data-parallel ranks); HF's check wants micro x accumulation "
                "x world size"
            )
    for key in sorted(set(fa) | set(fb)):
        a, b = fa.get(key, MISSING), fb.get(key, MISSING)
        why = _not_training(key) or _reported(key, not_carried)
        if why:
            if _value(a, key, fa) != _value(b, key, fb):
                why += "" if why.startswith("not carried by ftkit import") else "; no effect on training"
                notes.append(f"{key}: {_show(a)} vs {_show(b)} rendered: not compared ({why})")
            continue
        skip_a, skip_b = relevant(key, fa), relevant(key, fb)
        if skip_a and skip_b:
            continue
        note = ""
        if a == "auto" and b == "auto":  # the one value a rendered config leaves to HF (the step count of epochs)
            notes.append(f'{key}: "auto" in both: HF fills it at run time')
            continue
        if a == "auto":
            resolved, how = _auto(key, plan, fa)
            if resolved is None:
                diffs.append(Difference(key, a, b, "auto", how or "HF and Accelerate do not fill it"))
                continue
            a, note = resolved, f'"auto": {how}'
        va, vb = _value(a, key, fa), _value(b, key, fb)
        if va is MISSING and vb is MISSING:
            continue
        if va is MISSING:
            diffs.append(Difference(key, a, b, "only rendered", note))
        elif vb is MISSING:
            diffs.append(Difference(key, a, b, "only in file", note))
        elif not _equal(va, vb):
            if a is MISSING:
                note = f"absent: DeepSpeed's default {fmt(va)}"
            elif b is MISSING:
                note = f"the recipe leaves it to DeepSpeed's default {fmt(vb)}"
            diffs.append(Difference(key, a if a is not MISSING else va, b if b is not MISSING else vb, "differs", note))
        elif note:
            notes.append(f"{key}: {note} = {fmt(vb)} rendered")
    return diffs, notes


def _schedule_defaults(flat: dict[str, object]) -> None:
    """A DeepSpeed schedule's parameters a config leaves out, as DeepSpeed's class fills them (WarmupLR's peak: the
    optimizer's lr)."""
    kind = schedule_name(flat.get("scheduler.type"))
    if kind is None:
        return
    for name, default in SCHEDULE_PARAMS[kind].items():
        key = f"scheduler.params.{name}"
        if key in flat:
            continue
        if name == "warmup_max_lr" and default is None:
            flat[key] = flat.get("optimizer.params.lr", "auto")
        elif default is not None:
            flat[key] = default


def _not_carried(file_cfg: Mapping[str, object]) -> dict[str, str]:
    """The keys ``ftkit import`` reports as not carried for this file (no effect on training, or the same update up
    to rounding), by canonical key: check compares what import carries, so an imported recipe never fails check
    against its own source."""
    report = Report()
    deepspeed.read(report.sink("--against"), file_cfg)
    out: dict[str, str] = {}
    for c in report.claims:
        if c.status == NO_EFFECT and not c.key.endswith("(absent)"):
            out[canonical_key(c.key)] = "not carried by ftkit import: " + "; ".join(x for x in (c.how, c.effect) if x)
    return out


def _reported(key: str, not_carried: Mapping[str, str]) -> str | None:
    for name, why in not_carried.items():
        if key == name or key.startswith(name + "."):
            return why
    return None


def _not_training(key: str) -> str | None:
    if key in NOT_TRAINING:
        return NOT_TRAINING[key]
    if key.startswith(NOT_TRAINING_PREFIXES):
        return "logging, monitoring or file options"
    return None


def _value(value: object, key: str, flat: Mapping[str, object]) -> object:
    """A side's effective value: its own, or DeepSpeed's default when it leaves the key out."""
    if value is not MISSING:
        return value
    if key == "zero_optimization.overlap_comm":  # DeepSpeed's dynamic default: on at stage 3
        return flat.get("zero_optimization.stage", 0) == 3
    if key == "gradient_clipping":
        return default_clipping()[0]
    if key.startswith("fp16.") and key != "fp16.enabled" and flat.get("fp16.enabled") is not True:
        return MISSING
    return DEFAULTS.get(key, MISSING)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _auto(key: str, plan: Plan | None, flat: Mapping[str, object]) -> tuple[object, str]:
    """What HF Trainer (or Accelerate) fills into ``"auto"`` at ``key`` with the recipe's TrainingArguments and
    model; (None, why) when nobody fills it."""
    if plan is None:
        return None, "no recipe to resolve it with"
    r = plan.recipe
    h = plan.hidden_size
    filled: dict[str, tuple[object, str]] = {
        "train_batch_size": (plan.global_batch_size, "HF: micro x accumulation x world size"),
        "train_micro_batch_size_per_gpu": (plan.micro_batch_size, "HF: per_device_train_batch_size"),
        "gradient_accumulation_steps": (plan.grad_accum, "HF: gradient_accumulation_steps"),
        "gradient_clipping": (r.train.max_grad_norm, "HF: max_grad_norm"),
        "optimizer.params.lr": (r.train.learning_rate, "HF: learning_rate"),
        "optimizer.params.betas": ([r["train.adam_beta1"], r["train.adam_beta2"]], "HF: adam_beta1, adam_beta2"),
        "optimizer.params.eps": (r.train.adam_epsilon, "HF: adam_epsilon"),
        "optimizer.params.weight_decay": (r.train.weight_decay, "HF: weight_decay"),
        "fp16.enabled": (r.train.precision == "fp16", "HF: fp16"),
        "bf16.enabled": (r.train.precision == "bf16", "HF: bf16"),
        "scheduler.params.warmup_max_lr": (r.train.learning_rate, "HF: learning_rate"),
        "scheduler.params.warmup_min_lr": (0, "HF: 0"),
        "scheduler.params.warmup_num_steps": (max(1, r.train.warmup_steps), "HF: warmup_steps (at least 1)"),
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
            False,
            "Accelerate: zero3_save_16bit_model, false unless set",
        ),
    }
    if h:
        filled["zero_optimization.reduce_bucket_size"] = (h * h, f"HF: hidden_size^2 = {h}^2")
        if flat.get("zero_optimization.stage") == 3:
            filled["zero_optimization.stage3_prefetch_bucket_size"] = (int(0.9 * h * h), "HF: int(0.9 x hidden^2)")
            filled["zero_optimization.stage3_param_persistence_threshold"] = (10 * h, "HF: 10 x hidden_size")
    if r.train.max_steps is not None:
        filled["scheduler.params.total_num_steps"] = (r.train.max_steps, "HF: the run's optimizer steps")
    if key in filled:
        return filled[key]
    return None, "HF and Accelerate do not fill it"


# ---------------------------------------------------------------------------------------------------------------
# Accelerate YAML

_ACCEL_COMPARED = ("distributed_type", "num_machines", "num_processes", "use_cpu", "mixed_precision")
_PLUGIN_TO_DS = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
}


def compare_accelerate(
    file_cfg: Mapping[str, object], rendered: Mapping[str, object], rendered_ds: Mapping[str, object] | None
) -> tuple[list[Difference], list[str]]:
    diffs: list[Difference] = []
    notes: list[str] = []
    for key in _ACCEL_COMPARED:
        a, b = file_cfg.get(key, MISSING), rendered.get(key, MISSING)
        if key == "distributed_type" and isinstance(a, str):
            a = a.upper()
        if a is MISSING and b is not MISSING and key in _ACCEL_DEFAULTS:  # accelerate launch's default for it
            a = _ACCEL_DEFAULTS[key]
        if key == "num_processes" and a is MISSING and b is not MISSING:
            notes.append(f"num_processes: (absent) vs {_show(b)} rendered: not compared (accelerate launch then "
                         "starts one process per GPU of the machine)")  # fmt: skip
            continue
        if a is MISSING and b is MISSING:
            continue
        if a is MISSING:
            diffs.append(Difference(key, a, b, "only rendered"))
        elif b is MISSING and key == "mixed_precision" and not _config_file(file_cfg) and rendered_ds is not None:
            # Accelerate's DeepSpeed plugin turns mixed_precision into the config's bf16/fp16 blocks
            b = _ds_precision(rendered_ds)
            if str(a).lower().replace("none", "no").replace("false", "no") != b:
                diffs.append(Difference(key, a, b, "differs", "rendered as ds_config.json's bf16/fp16 blocks"))
        elif b is MISSING:
            note = "Accelerate refuses it next to a deepspeed_config_file" if key == "mixed_precision" else ""
            diffs.append(Difference(key, a, b, "only in file", note))
        elif key == "distributed_type" and a in _DATA_PARALLEL and b == "DEEPSPEED" and _stage(rendered_ds) == 0:
            notes.append(f"distributed_type: {_show(a)} vs \"DEEPSPEED\" rendered at ZeRO stage 0: not compared (the "
                         "same data-parallel update, as ftkit import maps it)")  # fmt: skip
        elif str(a).lower() != str(b).lower():
            diffs.append(Difference(key, a, b, "differs"))
    if str(file_cfg.get("distributed_type", "")).upper() == "FSDP" and rendered.get("distributed_type") == "FSDP":
        d2, n2 = compare_fsdp(file_cfg.get("fsdp_config"), rendered.get("fsdp_config"))
        diffs += d2
        notes += n2
    plugin = file_cfg.get("deepspeed_config") or {}
    if isinstance(plugin, dict) and not plugin.get("deepspeed_config_file") and rendered_ds is not None:
        flat = canonical(rendered_ds)
        for sub, ds_key in _PLUGIN_TO_DS.items():
            if sub in plugin:
                a, b = plugin[sub], flat.get(ds_key, DEFAULTS.get(ds_key, "none"))
                if str(a).lower() == "auto":
                    notes.append(f'deepspeed_config.{sub}: "auto": HF fills it from TrainingArguments')
                elif not _equal(canonical({"x": a})["x"], b):
                    diffs.append(Difference(f"deepspeed_config.{sub}", a, b, "differs", f"rendered as {ds_key}"))
    for key in sorted(set(file_cfg) - set(_ACCEL_COMPARED) - {"deepspeed_config"}):
        if key in ("main_process_ip", "main_process_port") and key in rendered and file_cfg[key] != rendered[key]:
            notes.append(f"{key}: {_show(file_cfg[key])} vs {_show(rendered[key])} rendered (launch only)")
    rendered_plugin = rendered.get("deepspeed_config")
    for key in ("zero3_init_flag", "deepspeed_multinode_launcher"):
        a, b = (
            plugin.get(key, MISSING) if isinstance(plugin, dict) else MISSING,
            rendered_plugin.get(key, MISSING) if isinstance(rendered_plugin, dict) else MISSING,
        )
        if a is not MISSING and b is not MISSING and a != b:
            notes.append(f"deepspeed_config.{key}: {_show(a)} vs {_show(b)} rendered (loading/launch only)")
    return diffs, notes


_DATA_PARALLEL = ("MULTI_GPU", "NO", "MULTI_CPU")  # plain data parallelism: DeepSpeed's stage 0 does the same


def _stage(rendered_ds: Mapping[str, object] | None) -> int | None:
    return stage_of(canonical(rendered_ds)) if rendered_ds is not None else None


_ACCEL_DEFAULTS: dict[str, object] = {"use_cpu": False, "mixed_precision": "no", "num_machines": 1}
# recipe keys of an FSDP block and the rendered fsdp_config key (with its value in the recipe's terms)
_FSDP_RENDERED: dict[str, tuple[str, dict[object, object]]] = {
    "fsdp.reshard_after_forward": ("fsdp_reshard_after_forward", {}),
    "fsdp.offload_params": ("fsdp_offload_params", {}),
    "fsdp.state_dict_type": ("fsdp_state_dict_type", {k: v for k, v in fsdp.STATE_DICTS.items()}),
    "fsdp.cpu_ram_efficient_loading": ("fsdp_cpu_ram_efficient_loading", {}),
    "model.gradient_checkpointing": ("fsdp_activation_checkpointing", {}),
    "fsdp.transformer_layer_cls": ("fsdp_transformer_layer_cls_to_wrap", {}),
}


def compare_fsdp(file_block: object, rendered_block: object) -> tuple[list[Difference], list[str]]:
    """A file's ``fsdp_config`` (FSDP1 or 2) against the rendered FSDP2 one, by meaning: both read as ``ftkit
    import`` reads them (FSDP1's keys converted like ``accelerate to-fsdp2``, a left-out key at accelerate launch's
    default); a key import does not carry (same update) is a note, a key it refuses a difference."""
    block = file_block if isinstance(file_block, dict) else {}
    rendered = rendered_block if isinstance(rendered_block, dict) else {}
    version = fsdp.fsdp_version(block)
    values, not_carried, refused = fsdp.canonical(block, version)
    mine, _, _ = fsdp.canonical(rendered, 2)
    diffs: list[Difference] = []
    notes = [f"fsdp_config.{k}: not compared ({why})" for k, why in not_carried.items()]
    if version == 1:
        notes.append("fsdp_config: FSDP1, compared as FSDP2 (accelerate to-fsdp2's conversion; ftkit runs FSDP2)")
    for key, why in refused.items():
        diffs.append(Difference(f"fsdp_config.{key}", block.get(key, MISSING), MISSING, "only in file", why))
    defaults: dict[str, object] = {  # FSDP's own defaults under accelerate launch, for a key the file leaves out
        "fsdp.reshard_after_forward": True,
        "fsdp.offload_params": False,
        "fsdp.state_dict_type": "full" if version == 1 else "sharded",
        "fsdp.cpu_ram_efficient_loading": True,
        "model.gradient_checkpointing": False,
    }
    for target, (rendered_key, _) in _FSDP_RENDERED.items():
        source_key, a = values.get(target, (f"{rendered_key} (absent)", defaults.get(target, MISSING)))
        _, b = mine.get(target, ("", MISSING))
        if target == "fsdp.transformer_layer_cls" and a is MISSING:
            if b is not MISSING:
                notes.append(f"fsdp_config.{rendered_key}: (absent) vs {_show(b)} rendered: not compared (Accelerate "
                             "wraps the model's _no_split_modules; ftkit's auto derives the same class)")  # fmt: skip
            continue
        if a is MISSING and b is MISSING:
            continue
        if not _equal(a, b):
            key = source_key.removesuffix(" (absent)")
            note = "absent: FSDP's default under accelerate launch" if source_key.endswith("(absent)") else ""
            diffs.append(Difference(f"fsdp_config.{key}", a, b, "differs", f"{target}; {note}" if note else target))
    return diffs, notes


def _config_file(file_cfg: Mapping[str, object]) -> bool:
    plugin = file_cfg.get("deepspeed_config")
    return isinstance(plugin, dict) and bool(plugin.get("deepspeed_config_file"))


def _ds_precision(rendered_ds: Mapping[str, object]) -> str:
    """Accelerate's mixed_precision of a DeepSpeed config: bf16, fp16 or no."""
    flat = canonical(rendered_ds)
    return "bf16" if flat.get("bf16.enabled") is True else "fp16" if flat.get("fp16.enabled") is True else "no"


def check_against(plan: Plan, files: tuple[str, ...] | list[str]) -> tuple[list[str], int]:
    """The lines ``ftkit check --against`` prints for each file, and the number of differences."""
    lines: list[str] = []
    count = 0
    for file in files:
        diffs, notes = diff_against(plan, file)
        count += len(diffs)
        lines += [d.line(file) for d in diffs]
        lines += [f"{file} {n}" for n in notes if "not compared" in n]
        if not diffs:
            lines.append(f"{file}: equivalent to what the recipe renders")
    return lines, count
