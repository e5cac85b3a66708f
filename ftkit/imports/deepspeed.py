"""DeepSpeed JSON (``ds_config.json``) -> claims on the recipe; DeepSpeed's spellings and defaults, once.

What HF Trainer does with the file decides the mapping (transformers ``integrations/deepspeed.py``): ``"auto"`` in
the batch triple, ``gradient_clipping``, ``fp16/bf16.enabled`` and the optimizer's parameters is filled from
TrainingArguments (a concrete value must equal them); ``"auto"`` bucket sizes come from the model's hidden size
(``reduce_bucket_size = h^2``, ``stage3_prefetch_bucket_size = int(0.9 h^2)``, ``stage3_param_persistence_threshold
= 10 h``), which ftkit's own ``auto`` derives the same way. A key the file leaves out takes DeepSpeed's default,
and some absences change training (no ``gradient_clipping``: DeepSpeed does not clip, and TrainingArguments'
``max_grad_norm`` is not used under DeepSpeed).

:func:`canonical` is the other half: a config flattened to DeepSpeed's canonical key names with its aliases and
deprecated spellings folded in, which ``ftkit check --against`` compares (:mod:`ftkit.imports.against`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ftkit.imports.mapping import ACCUM, BF16, DS_OPTIMIZER, FP16, GLOBAL, MAPPED, MICRO, NO_EFFECT, Sink, fmt
from ftkit.imports.values import is_auto, to_bool, to_float, to_int, to_mapping, to_str
from ftkit.recipe.schema import Value
from ftkit.rundir.records import JSON

# zero_optimization keys: DeepSpeed's aliases and deprecated spellings -> the spelling ftkit renders.
ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",  # deprecated
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
STAGE12_ONLY = {
    "allgather_partitions",
    "allgather_bucket_size",
    "reduce_scatter",
    "round_robin_gradients",
    "legacy_stage1",
    "use_multi_rank_bucket_allreduce",
}
STAGE3_ONLY = {
    "sub_group_size",
    "offload_param",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "leaf_module",
    "zeropp_loco_param",
}

# DeepSpeed's defaults (0.19) for the keys ftkit renders or maps, by canonical dotted key: what an absent key means.
DEFAULTS: dict[str, JSON] = {
    "gradient_clipping": 0.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "fp16.enabled": False,
    "fp16.auto_cast": False,
    "fp16.loss_scale": 0,
    "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2,
    "fp16.consecutive_hysteresis": False,
    "fp16.min_loss_scale": 1,
    "bf16.enabled": False,
    "zero_optimization.stage": 0,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.offload_optimizer.pin_memory": True,
    "zero_optimization.offload_param.pin_memory": True,
    "zero_optimization.zero_hpz_partition_size": 1,
    "zero_optimization.zero_quantized_weights": False,
    "zero_optimization.zero_quantized_gradients": False,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "optimizer.params.adam_w_mode": True,
    "optimizer.params.torch_adam": False,
    "compile.disable": True,
}

_LOGGING = "DeepSpeed's own logging/monitoring; HF Trainer logs every train.logging_steps to train.report_to"
NO_EFFECT_TOP = {
    "steps_per_print": "DeepSpeed's own progress print (HF Trainer logs every train.logging_steps)",
    "wall_clock_breakdown": "DeepSpeed's timing printout",
    "dump_state": "prints DeepSpeed's state at start-up",
    "memory_breakdown": "DeepSpeed's memory printout",
    "comms_logger": _LOGGING,
    "comms_config": _LOGGING,
    "monitor_config": _LOGGING,
    "tensorboard": _LOGGING,
    "wandb": _LOGGING,
    "csv_monitor": _LOGGING,
    "flops_profiler": "DeepSpeed's FLOPs profiler",
    "timers": "DeepSpeed's throughput timers",
    "zero_allow_untested_optimizer": "lets ZeRO run an optimizer DeepSpeed has not tested; ftkit always configures "
    "DeepSpeed's own AdamW, so it never applies",
    "zero_force_ds_cpu_optimizer": "refuses a non-DeepSpeed optimizer with offload; ftkit always configures "
    "DeepSpeed's AdamW (CPU Adam when offloading)",
    "activation_checkpointing": "DeepSpeed's activation-checkpointing API, which HF models do not call (they use "
    "torch's: model.gradient_checkpointing)",
    "checkpoint": "checkpoint file options; ftkit's commit records decide what is saved and resumed",
    "aio": "NVMe offload I/O tuning: speed only",
    "autotuning": "settings of the DeepSpeed autotuner, used only under `deepspeed --autotuning`",
}
HARD_TOP = {
    "fp8": "fp8 training (Transformer Engine) is not supported by ftkit: bf16, fp16 or fp32 only",
    "msamp": "fp8 training (MS-AMP) is not supported by ftkit: bf16, fp16 or fp32 only",
    "amp": "apex AMP is not supported by ftkit: bf16, fp16 (DeepSpeed's) or fp32 only",
}
REFUSED_TOP = {
    "tensor_parallel": (
        "DeepSpeed AutoTP tensor parallelism: ftkit trains data-parallel only",
        "each rank holds whole layers (more memory) and every rank is a data-parallel rank, so the global batch "
        "per step grows by the tensor-parallel size",
    ),
    "sequence_parallel": (
        "DeepSpeed Ulysses/ALST sequence parallelism: not supported by ftkit",
        "each rank processes whole sequences (more activation memory; long sequences may not fit)",
    ),
    "sequence_parallel_size": ("sequence parallelism: not supported by ftkit", "each rank processes whole sequences"),
    "data_types": ("DeepSpeed's gradient-accumulation dtype", "gradients accumulate in DeepSpeed's default dtype"),
    "communication_data_type": ("the dtype of gradient reduction", "gradients are reduced in DeepSpeed's default"),
    "elasticity": ("DeepSpeed elastic training changes the batch with the world size", "a fixed global batch"),
    "curriculum_learning": ("curriculum learning", "all examples from the first step"),
    "data_efficiency": ("DeepSpeed's data efficiency library", "plain data sampling"),
    "pipeline": ("pipeline parallelism", "data parallelism only"),
    "hybrid_engine": ("DeepSpeed's RLHF hybrid engine", "plain training"),
    "sparse_attention": ("DeepSpeed sparse attention", "the model's own attention"),
    "torch_autocast": ("torch.autocast under DeepSpeed", "DeepSpeed's bf16/fp16 mixed precision"),
    "sparse_gradients": ("sparse embedding gradients", "dense gradients"),
}
ROUNDING = "same update up to floating-point rounding"


def read(sink: Sink, data: object) -> None:
    """Claims for every key of a DeepSpeed config (a parsed JSON object)."""
    cfg = to_mapping(sink, None, data)
    if cfg is None:
        return
    zero = cfg.get("zero_optimization")
    stage = 0
    if isinstance(zero, dict) and "stage" in zero:
        stage = to_int(sink, "zero_optimization.stage", zero["stage"]) or 0
        if stage > 3:
            sink.problem("zero_optimization.stage", f"must be 0, 1, 2 or 3; got {stage}")
    for key, value in cfg.items():
        _top(sink, str(key), value, stage)
    if "zero_optimization" not in cfg:
        sink.implied("zero_optimization", "zero.stage", 0, "DeepSpeed's default: no ZeRO (stage 0)")
    absent_defaults(sink, zero if isinstance(zero, dict) else {}, stage)
    scheduler_sets_lr(sink)
    if "gradient_clipping" not in cfg:
        value, which = default_clipping()
        sink.implied(
            "gradient_clipping",
            "train.max_grad_norm",
            value,
            f"{which} default {fmt(value)}{': no clipping' if not value else ''}; TrainingArguments' max_grad_norm is "
            "not used under DeepSpeed",
        )


def default_clipping() -> tuple[float, str]:
    """DeepSpeed's default gradient_clipping, read from the installed DeepSpeed's constants without importing it:
    0.0 (no clipping) for years, 1.0 since DeepSpeed PR #8068 (2026)."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("deepspeed")
        origin = spec.origin if spec else None
        text = (Path(origin).parent / "runtime" / "constants.py").read_text(encoding="utf-8") if origin else ""
    except (ImportError, OSError, ValueError):
        text = ""
    found = re.search(r"^GRADIENT_CLIPPING_DEFAULT\s*=\s*([0-9.eE+-]+)", text, flags=re.M)
    if found:
        return float(found.group(1)), "the installed DeepSpeed's"
    return 1.0, "DeepSpeed's (not installed here; 1.0 since PR #8068, 0.0 before)"


def absent_defaults(sink: Sink, zero: Mapping[str, object], stage: int, prefix: str = "zero_optimization") -> None:
    """Keys the config leaves out take DeepSpeed's default, which ftkit's rule might not equal (a bucket sized by
    the hidden size, overlap at stage 1/2 when memory allows, 1e8 live parameters when memory is tight): the
    recipe keeps DeepSpeed's value, so the rendered config does what the source did. Write ``auto`` in the recipe
    to let ftkit decide instead."""
    names = {ZERO_ALIASES.get(str(k), str(k)) for k in zero}
    blocks = [b for k in ("offload_optimizer", "offload_param") if isinstance(b := zero.get(k), dict)]
    offload = any(str(b.get("device", "none")).lower() != "none" for b in blocks) or any(
        zero.get(k) is True for k in ("cpu_offload", "cpu_offload_param")
    )
    pinned = any("pin_memory" in b for b in blocks)
    wanted: list[tuple[str, str, Value]] = []
    if stage in (1, 2):
        wanted += [
            ("reduce_bucket_size", "zero.reduce_bucket_size", 500_000_000),
            ("allgather_bucket_size", "zero.allgather_bucket_size", 500_000_000),
            ("overlap_comm", "zero.overlap_comm", False),
        ]
        if offload:
            wanted.append(("round_robin_gradients", "zero.round_robin_gradients", False))
    elif stage == 3:
        wanted += [
            ("reduce_bucket_size", "zero.reduce_bucket_size", 500_000_000),
            ("stage3_prefetch_bucket_size", "zero.prefetch_bucket_size", 50_000_000),
            ("stage3_param_persistence_threshold", "zero.param_persistence_threshold", 100_000),
            ("stage3_max_live_parameters", "zero.max_live_parameters", 1_000_000_000),
            ("stage3_max_reuse_distance", "zero.max_reuse_distance", 1_000_000_000),
        ]
    if stage and offload and not pinned and "cpu_offload_use_pin_memory" not in names:
        wanted.append(("offload.pin_memory", "zero.pin_memory", True))
    for name, target, default in wanted:
        if name not in names:
            sink.implied(
                f"{prefix}.{name}", target, default, "DeepSpeed's default; auto in the recipe lets ftkit decide"
            )


def _top(sink: Sink, key: str, value: object, stage: int) -> None:
    if key.startswith("_") or key.lower() in ("comment", "comments", "description"):
        sink.no_effect(key, "a comment; DeepSpeed ignores it")
    elif key == "train_batch_size":
        _int_or_auto(sink, key, value, GLOBAL, minimum=1)
    elif key == "train_micro_batch_size_per_gpu":
        _int_or_auto(sink, key, value, MICRO, minimum=1)
    elif key == "gradient_accumulation_steps":
        _int_or_auto(sink, key, value, ACCUM, minimum=1)
    elif key == "gradient_clipping":
        if is_auto(value):
            sink.auto(key, "train.max_grad_norm")
        elif (v := to_float(sink, key, value, minimum=0)) is not None:
            sink.map(key, "train.max_grad_norm", v)
    elif key == "fp16":
        _fp16(sink, key, value)
    elif key in ("bf16", "bfloat16"):
        _bf16(sink, key, value)
    elif key == "optimizer":
        _optimizer(sink, key, value)
    elif key == "scheduler":
        _scheduler(sink, key, value)
    elif key == "zero_optimization":
        if (block := to_mapping(sink, key, value)) is not None:
            for sub, item in block.items():
                _zero(sink, f"{key}.{sub}", str(sub), item, stage)
    elif key in HARD_TOP:
        if key in ("amp", "fp8") and isinstance(value, dict) and value.get("enabled") is False:
            sink.same_each(key, value, "disabled")
        else:
            sink.hard(key, HARD_TOP[key])
    elif key in NO_EFFECT_TOP:
        sink.no_effect_each(key, value, NO_EFFECT_TOP[key], "no effect on training")
    elif key == "prescale_gradients":
        if to_bool(sink, key, value) is False:  # a boolean: True must not pass for the default (True == 1)
            sink.same(key, "DeepSpeed's default (false)")
        elif value is not None:
            sink.no_effect(key, "gradients divided by the world size before the all-reduce, not after", ROUNDING)
    elif key == "gradient_predivide_factor":
        if isinstance(value, bool) or (f := to_float(sink, key, value, minimum=0)) is None:
            if isinstance(value, bool):
                sink.problem(key, f"expected a number, got boolean {fmt(value)}")
        elif f == 1.0:
            sink.same(key, "DeepSpeed's default (1.0)")
        else:
            sink.no_effect(key, f"gradients divided by {fmt(f)} before the all-reduce, the rest after", ROUNDING)
    elif key == "compile":
        block = to_mapping(sink, key, value)
        if block is not None and block.get("disable", True) is not True and block.get("enabled", True) is not False:
            old = " (DeepSpeed 0.19 rejects disable/backend here)" if {"disable", "backend"} & set(block) else ""
            sink.no_effect_each(key, block, f"torch.compile of the model{old}: ftkit does not compile", ROUNDING)
        elif block is not None:
            sink.same_each(key, block, "compile disabled")
    elif key == "tensor_parallel" and isinstance(value, dict) and value.get("autotp_size", 1) in (0, 1):
        sink.same_each(key, value, "tensor-parallel size 1: plain data parallelism")
    elif key == "tensor_parallel" and isinstance(value, dict):
        _tensor_parallel(sink, key, value)
    elif key == "sequence_parallel_size":
        if (n := to_int(sink, key, value, minimum=1)) is not None:
            if n == 1:
                sink.same(key, "sequence-parallel size 1: plain data parallelism")
            else:
                sink.map(key, "parallel.sp", n, "DeepSpeed Ulysses (ALST) sequence parallelism")
    elif key == "sequence_parallel" and isinstance(value, dict) and str(value.get("mode", "ulysses")) == "ulysses":
        _sequence_parallel(sink, key, value)
    elif key == "data_parallel_size":
        if to_int(sink, key, value, minimum=1) is not None:
            sink.same(key, "the data-parallel degree, which ftkit derives: world size / (parallel.tp x parallel.sp)")
    elif key in REFUSED_TOP:
        why, effect = REFUSED_TOP[key]
        sink.refuse(key, why, f"without it: {effect}")
    else:
        sink.unknown(key, value, "DeepSpeed")


# AutoTP's options besides its size (deepspeed/runtime/tensor_parallel/config.py, TPTrainingConfig): what ftkit does
# with each; a key not named here is refused (it may change how the layers are split)
AUTOTP_SAME = {"tp_overlap_comm": False, "keep_module_on_host": False, "replace_with_kernel_inject": False}


def _tensor_parallel(sink: Sink, key: str, value: Mapping[str, object]) -> None:
    """DeepSpeed AutoTP training (``tensor_parallel.autotp_size``): parallel.tp; its other options, DeepSpeed's
    defaults or refused."""
    for sub, item in value.items():
        k = f"{key}.{sub}"
        if sub == "autotp_size":
            if (n := to_int(sink, k, item, minimum=1)) is not None:
                sink.map(k, "parallel.tp", n, "DeepSpeed AutoTP tensor parallelism (train.backend deepspeed)")
        elif sub in AUTOTP_SAME and item == AUTOTP_SAME[sub]:
            sink.same(k, f"DeepSpeed's default ({fmt(item)})")
        elif sub == "tp_overlap_comm":
            sink.no_effect(k, "overlaps AutoTP's all-reduces with compute: speed only", ROUNDING)
        else:
            sink.refuse(k, f"an AutoTP option ftkit does not render ({sub})", "without it: AutoTP's defaults")


def _sequence_parallel(sink: Sink, key: str, value: Mapping[str, object]) -> None:
    """A ``sequence_parallel`` block (LLaMA-Factory's ALST configs: ``enabled``, ``size``, ``mode: ulysses``):
    parallel.sp."""
    enabled = value.get("enabled", True) is not False
    for sub, item in value.items():
        k = f"{key}.{sub}"
        if sub == "size":
            if (n := to_int(sink, k, item, minimum=1)) is not None:
                if enabled and n > 1:
                    sink.map(k, "parallel.sp", n, "DeepSpeed Ulysses (ALST) sequence parallelism")
                else:
                    sink.same(k, "no sequence parallelism")
        elif sub == "enabled":
            sink.same(k, "read with size")
        elif sub == "mode":
            sink.same(k, "Ulysses: what parallel.sp runs")
        else:
            sink.refuse(k, f"a sequence-parallel option ftkit does not render ({sub})", "without it: the defaults")


def _int_or_auto(sink: Sink, key: str, value: object, target: str, minimum: int) -> None:
    if is_auto(value):
        sink.auto(key, target)
    elif (v := to_int(sink, key, value, minimum=minimum)) is not None:
        sink.map(key, target, v)


def _fp16(sink: Sink, key: str, value: object) -> None:
    block = to_mapping(sink, key, value)
    if block is None:
        return
    for sub, v in block.items():
        k = f"{key}.{sub}"
        if sub == "enabled":
            _enabled(sink, k, v, FP16)
        elif sub in ("loss_scale", "min_loss_scale"):
            if (f := to_float(sink, k, v, minimum=0)) is not None:
                sink.map(k, f"train.fp16_{sub}", int(f) if f.is_integer() else f, "used only with fp16")
        elif sub in ("initial_scale_power", "loss_scale_window", "hysteresis"):
            if (i := to_int(sink, k, v)) is not None:
                sink.map(k, f"train.fp16_{sub}", i, "used only with fp16")
        elif sub == "auto_cast":
            b = to_bool(sink, k, v)
            if b is False:
                sink.same(k, "DeepSpeed's default (inputs are not cast)")
            elif b:
                sink.no_effect(k, "casts floating-point inputs to fp16", "token ids are integers: no effect on them")
        elif sub == "consecutive_hysteresis":
            b = to_bool(sink, k, v)
            if b is False:
                sink.same(k, "DeepSpeed's default")
            elif b:
                sink.refuse(k, "consecutive hysteresis of the loss scaler", "the loss scale recovers sooner")
        elif sub == "fp16_master_weights_and_grads":
            sink.refuse(k, "fp16 master weights", "fp32 master weights")
        else:
            sink.unknown(k, v, "DeepSpeed fp16")


def _bf16(sink: Sink, key: str, value: object) -> None:
    block = to_mapping(sink, key, value)
    if block is None:
        return
    for sub, v in block.items():
        k = f"{key}.{sub}"
        if sub == "enabled":
            _enabled(sink, k, v, BF16)
        elif sub in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            sink.no_effect(k, "bf16 has no loss scaling (DeepSpeed 0.19 refuses the key in its bf16 block)")
        elif sub == "auto_cast":
            sink.no_effect(k, "casts floating-point inputs (DeepSpeed 0.19 refuses the key in its bf16 block)")
        elif sub in ("immediate_grad_update", "check_grad_overflow"):
            sink.no_effect(k, "DeepSpeed bf16 optimizer detail", ROUNDING)
        else:
            sink.unknown(k, v, "DeepSpeed bf16")


def _enabled(sink: Sink, key: str, value: object, target: str) -> None:
    if is_auto(value):
        sink.auto(key, target)
    elif (b := to_bool(sink, key, value)) is not None:
        sink.map(key, target, b)


_OPT_PARAMS = {"lr": "train.learning_rate", "eps": "train.adam_epsilon", "weight_decay": "train.weight_decay"}
# DeepSpeed's Adam/AdamW (FusedAdam, CPU Adam) defaults for parameters the block leaves out
_OPT_DEFAULTS = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0}


def _optimizer(sink: Sink, key: str, value: object) -> None:
    block = to_mapping(sink, key, value)
    if block is None:
        return
    kind = str(block.get("type", "")).lower()
    params = block.get("params", {})
    if "type" not in block:
        sink.problem(key, "has no type: DeepSpeed needs optimizer.type (e.g. AdamW)")
    mode = params.get("adam_w_mode", True) if isinstance(params, dict) else True  # not a mapping: reported below
    adam_w = kind == "adamw" or (kind == "adam" and mode not in (False, "false"))
    for sub, v in block.items():
        k = f"{key}.{sub}"
        if sub == "type":
            if adam_w:
                how = "DeepSpeed's Adam with adam_w_mode (the default) is AdamW" if kind == "adam" else ""
                sink.map(k, DS_OPTIMIZER, "AdamW", how)
            else:
                sink.refuse(k, f"optimizer {v}: ftkit trains with AdamW only", "AdamW instead")
        elif sub == "params":
            if (given := to_mapping(sink, k, v)) is not None:
                _optimizer_params(sink, k, given, adam_w)
        else:
            sink.unknown(k, v, "DeepSpeed optimizer")
    if adam_w and isinstance(params, dict):
        for name in ("lr", "betas", "eps", "weight_decay"):
            if name not in params:
                how = f"DeepSpeed's AdamW default {fmt(_OPT_DEFAULTS.get(name, [0.9, 0.999]))} applies"
                if name == "betas":
                    sink.implied(f"{key}.params.betas", "train.adam_beta1", 0.9, how)
                    sink.implied(f"{key}.params.betas", "train.adam_beta2", 0.999, how)
                else:
                    sink.implied(f"{key}.params.{name}", _OPT_PARAMS[name], _OPT_DEFAULTS[name], how)


def _optimizer_params(sink: Sink, key: str, params: Mapping[str, object], adam_w: bool) -> None:
    for sub, v in params.items():
        k = f"{key}.{sub}"
        if sub in _OPT_PARAMS:
            if is_auto(v):
                sink.auto(k, _OPT_PARAMS[sub])
            elif (f := to_float(sink, k, v, minimum=0)) is not None:
                sink.map(k, _OPT_PARAMS[sub], f)
        elif sub == "betas":
            if is_auto(v):
                sink.auto(k, "train.adam_beta1")
                sink.auto(k, "train.adam_beta2")
            elif isinstance(v, list) and len(v) == 2:
                b1, b2 = (to_float(sink, k, x, minimum=0) for x in v)
                if b1 is not None and b2 is not None:
                    sink.map(k, "train.adam_beta1", b1)
                    sink.map(k, "train.adam_beta2", b2)
            else:
                sink.problem(k, f"expected [beta1, beta2], got {fmt(v)}")
        elif sub == "adam_w_mode":
            if adam_w:
                sink.same(k, "decoupled weight decay: AdamW")
        elif sub in ("torch_adam", "fused"):
            b = to_bool(sink, k, v)
            if b is not None:
                sink.no_effect(
                    k,
                    f"{sub} {fmt(b)}: ftkit picks the implementation (torch's fused AdamW, or with optimizer "
                    "offload DeepSpeed's CPU Adam where every host can build it: zero.cpu_adam)",
                    ROUNDING,
                )
        elif sub in ("bias_correction", "amsgrad"):
            if v in (True, "true") and sub == "bias_correction" or v in (False, "false") and sub == "amsgrad":
                sink.same(k, "AdamW's default")
            else:
                sink.refuse(k, f"{sub} {fmt(v)}", "plain AdamW instead")
        else:
            sink.unknown(k, v, "DeepSpeed optimizer parameter")


# DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py, 0.19): each parameter's recipe key, and its default.
# The peak, the warm-up length and the schedule's length are train.* keys (HF fills them into "auto" from
# TrainingArguments: learning_rate, warmup_steps, the run's optimizer steps); the rest live in the scheduler section.
SCHEDULE_PARAMS: dict[str, dict[str, JSON]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {
        "total_num_steps": None,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
    "OneCycle": {
        "cycle_min_lr": None,
        "cycle_max_lr": None,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 0.001,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
    },
}
# parameters DeepSpeed has no default for: the schedule cannot be built without them
_SCHEDULE_REQUIRED = {"total_num_steps", "cycle_min_lr", "cycle_max_lr"}
# parameters HF Trainer fills when they say "auto" (transformers integrations/deepspeed.py); any other "auto" reaches
# DeepSpeed as text
_HF_FILLED_SCHEDULE = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"}


def _scheduler(sink: Sink, key: str, value: object) -> None:
    """DeepSpeed's own schedule, carried: train.lr_scheduler names it and ftkit renders it back into
    ds_config.json (HF Trainer hands the block to DeepSpeed instead of building a schedule of its own)."""
    block = to_mapping(sink, key, value)
    if block is None:
        return
    kind = str(block.get("type", ""))
    params = given if isinstance(given := block.get("params", {}), dict) else {}
    known = SCHEDULE_PARAMS.get(kind)
    for sub, v in block.items():
        k = f"{key}.{sub}"
        if sub == "type":
            if known is not None:
                sink.map(k, "train.lr_scheduler", kind, "DeepSpeed's own schedule, rendered into ds_config.json")
            else:
                spelled = next((n for n in SCHEDULE_PARAMS if n.lower() == kind.lower()), None)
                if spelled:
                    sink.problem(k, f"DeepSpeed looks the schedule up as spelled: {spelled}, not {fmt(v)}")
                    continue
                c = sink.refuse(
                    k,
                    f"schedule {fmt(v)} (DeepSpeed builds other names from torch.optim.lr_scheduler): ftkit carries "
                    f"DeepSpeed's own ({', '.join(SCHEDULE_PARAMS)}) and HF's",
                    "accepted: the recipe gets HF's linear schedule",
                )
                c.target, c.value = "train.lr_scheduler", "linear"  # the value used when accepted
        elif sub == "params":
            if (given := to_mapping(sink, k, v)) is not None and known is not None:
                for name, pv in given.items():
                    _schedule_param(sink, f"{k}.{name}", kind, str(name), pv)
            elif given is not None:
                for name in given:
                    sink.no_effect(f"{k}.{name}", f"a parameter of {kind}, which is not carried", "")
        else:
            sink.unknown(k, v, "DeepSpeed scheduler")
    if known is None:
        return
    if "type" not in block:
        sink.problem(key, "has no type: DeepSpeed needs scheduler.type (e.g. WarmupLR)")
        return
    for name, default in known.items():
        if name in params:
            continue
        if name in _SCHEDULE_REQUIRED:
            sink.problem(f"{key}.params", f"{kind} needs {name}: DeepSpeed has no default for it")
        elif name == "warmup_num_steps":
            sink.implied(f"{key}.params.{name}", "train.warmup_steps", 1000, "DeepSpeed's default 1000 warm-up steps")
        elif name == "warmup_max_lr" and default is not None:
            sink.implied(f"{key}.params.{name}", "train.learning_rate", 0.001, f"{kind}'s default peak 0.001")


def schedule_name(value: object) -> str | None:
    """DeepSpeed's spelling of a schedule named in any case (:func:`canonical` lower-cases it), or None."""
    return next((n for n in SCHEDULE_PARAMS if isinstance(value, str) and n.lower() == value.lower()), None)


def _schedule_param(sink: Sink, key: str, kind: str, name: str, value: object) -> None:
    if name not in SCHEDULE_PARAMS[kind]:
        if name == "last_batch_iteration":
            if to_int(sink, key, value, minimum=-1) == -1:
                sink.same(key, "-1: the schedule starts at step 0 (DeepSpeed restores it from a checkpoint)")
            elif value is not None:
                sink.refuse(key, f"the schedule starts at step {fmt(value)}", "it starts at step 0")
        else:
            sink.unknown(key, value, f"DeepSpeed {kind} parameter")
        return
    if is_auto(value):
        if name not in _HF_FILLED_SCHEDULE:
            sink.problem(key, '"auto": HF fills only warmup_min_lr, warmup_max_lr, warmup_num_steps and '
                         "total_num_steps; DeepSpeed would get the text \"auto\"")  # fmt: skip
        elif name == "warmup_max_lr":
            sink.auto(key, "train.learning_rate")
        elif name == "warmup_num_steps":
            sink.auto(key, "train.warmup_steps", "HF fills max(1, warmup_steps)")
        elif name == "warmup_min_lr":
            sink.map(key, "scheduler.warmup_min_lr", 0.0, '"auto": HF fills 0')
        else:  # total_num_steps
            sink.auto_filled(key, "HF fills the run's optimizer steps (train.max_steps, or counted from the data)")
        return
    if isinstance(value, list):
        sink.refuse(key, "a value per parameter group: ftkit trains one group", "one value for every parameter")
        return
    if name == "warmup_max_lr":
        if (f := to_float(sink, key, value, minimum=0)) is not None:
            sink.map(key, "train.learning_rate", f, "the schedule's peak")
    elif name == "warmup_num_steps":
        if (i := to_int(sink, key, value, minimum=1)) is not None:
            sink.map(key, "train.warmup_steps", i)
    elif name == "total_num_steps":
        if (i := to_int(sink, key, value, minimum=1)) is not None:
            sink.map(key, "train.max_steps", i, "the schedule's length: the run's optimizer steps")
    elif name == "warmup_type":
        if str(value) in ("log", "linear"):
            sink.map(key, "scheduler.warmup_type", str(value))
        else:
            sink.problem(key, f"must be log or linear; got {fmt(value)} (DeepSpeed would warn and use log)")
    elif name in ("cycle_momentum", "lr_range_test_staircase"):
        if (b := to_bool(sink, key, value)) is not None:
            sink.map(key, f"scheduler.{name}", b)
    elif isinstance(SCHEDULE_PARAMS[kind][name], int) or name.endswith(("_size", "_count")):
        minimum = 1 if name in ("cycle_first_step_size", "lr_range_test_step_size") else 0
        if value is None and name in ("cycle_second_step_size", "cycle_second_stair_count"):
            sink.same(key, "null: the first half's")
        elif (i := to_int(sink, key, value, minimum=minimum)) is not None:
            sink.map(key, f"scheduler.{name}", i)
    elif (f := to_float(sink, key, value, minimum=0)) is not None:
        sink.map(key, f"scheduler.{name}", f)


def scheduler_sets_lr(sink: Sink) -> None:
    """WarmupLR and WarmupDecayLR with a peak of their own (warmup_max_lr, stated or DeepSpeed's default) set the
    optimizer's learning rate at every step: the optimizer block's own lr is then not used (it is not carried,
    and the recipe's train.learning_rate is the schedule's peak)."""
    mine = [c for c in sink.report.claims if c.source == sink.source and c.target == "train.learning_rate"]
    peak = [c for c in mine if c.key.startswith("scheduler.")]
    if not peak:
        return
    for c in mine:
        if c.key.startswith("optimizer.") and c.status == MAPPED:
            c.status, c.target = NO_EFFECT, None
            c.how = "the schedule's warmup_max_lr sets the learning rate at every step: the optimizer's lr is not used"


def _zero(sink: Sink, key: str, sub: str, value: object, stage: int) -> None:
    name = ZERO_ALIASES.get(sub, sub)
    spelled = f" ({sub} is DeepSpeed's {'deprecated' if 'fp16' in sub else 'other'} spelling of {name})"
    spelled = spelled if name != sub else ""
    if sub == "stage":
        if 0 <= stage <= 3:
            sink.map(key, "zero.stage", stage)
        return
    if stage == 0:
        sink.no_effect(key, "DeepSpeed ignores it at stage 0 (no ZeRO)", "no effect on training")
        return
    if name in STAGE12_ONLY and stage == 3:
        sink.no_effect(key, "DeepSpeed ignores it at stage 3", "no effect on training")
        return
    if name in STAGE3_ONLY and stage < 3:
        sink.no_effect(key, f"DeepSpeed uses it only at stage 3 (this is stage {stage})", "no effect on training")
        return
    if name in ("offload_optimizer", "offload_param"):
        _offload(sink, key, name, value)
    elif name in ("contiguous_gradients", "round_robin_gradients", "overlap_comm"):
        if is_auto(value):
            sink.map(key, f"zero.{name}", "auto", "not filled by HF: ftkit's rule decides")
        elif (b := to_bool(sink, key, value)) is not None:
            sink.map(key, f"zero.{name}", b)
    elif name in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        field = {"stage3_prefetch_bucket_size": "prefetch_bucket_size"}.get(name, name)
        field = {"stage3_param_persistence_threshold": "param_persistence_threshold"}.get(field, field)
        rule = {
            "reduce_bucket_size": "hidden_size^2",
            "prefetch_bucket_size": "int(0.9 x hidden_size^2)",
            "param_persistence_threshold": "10 x hidden_size",
        }[field]
        if is_auto(value):
            sink.auto(key, f"zero.{field}", f"HF: {rule}{spelled}", "auto")
        elif (i := to_int(sink, key, value, minimum=1 if name == "reduce_bucket_size" else 0)) is not None:
            sink.map(key, f"zero.{field}", i, spelled.strip(" ()"))
    elif name in ("allgather_bucket_size", "sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance"):
        field = name.removeprefix("stage3_")
        if is_auto(value):
            sink.map(key, f"zero.{field}", "auto", "not filled by HF: ftkit's rule decides")
        elif (i := to_int(sink, key, value, minimum=0)) is not None:
            sink.map(key, f"zero.{field}", i, spelled.strip(" ()"))
    elif name == "stage3_gather_16bit_weights_on_model_save":
        how = (
            "ftkit always gathers the 16-bit weights at save (true) so the final model loads with from_pretrained"
            + spelled
        )
        if is_auto(value):
            sink.no_effect(key, f'"auto" (Accelerate fills its zero3_save_16bit_model, false unless set); {how}')
        elif to_bool(sink, key, value):
            sink.same(key, how.replace("ftkit always gathers", "ftkit gathers"))
        else:
            sink.no_effect(key, how, "no effect on training")
    elif name in ("cpu_offload", "cpu_offload_param", "cpu_offload_params"):
        b = to_bool(sink, key, value)
        target = "zero.offload_optimizer" if name == "cpu_offload" else "zero.offload_params"
        if b is not None:
            sink.map(key, target, "cpu" if b else "none", "DeepSpeed's deprecated spelling of the offload device")
    elif name == "cpu_offload_use_pin_memory":
        if (b := to_bool(sink, key, value)) is not None:
            sink.map(key, "zero.pin_memory", b, "deprecated spelling of the offload blocks' pin_memory")
    elif name in _ZERO_SAME:
        default, why, status, effect = _ZERO_SAME[name]
        if value == default or (isinstance(default, bool) and str(value).lower() == str(default).lower()):
            sink.same(key, f"DeepSpeed's default ({fmt(default)})")
        elif status == "refuse":
            sink.refuse(key, f"{why} ({fmt(value)})", effect)
        else:
            sink.no_effect(key, f"{why} ({fmt(value)})", effect)
    else:
        sink.unknown(key, value, "DeepSpeed zero_optimization")


_COMM = "same update; other memory use or communication"
# zero keys ftkit leaves at DeepSpeed's default: (default, what a other value does, refuse|no effect, effect)
_ZERO_SAME: dict[str, tuple[JSON, str, str, str]] = {
    "reduce_scatter": (True, "all-reduce instead of reduce-scatter", "no effect", _COMM),
    "allgather_partitions": (True, "all-gather per partition", "no effect", _COMM),
    "ignore_unused_parameters": (True, "fails on unused parameters", "no effect", "no effect on training"),
    "load_from_fp32_weights": (True, "resumes from 16-bit weights", "refuse", "resume from fp32 master weights"),
    "elastic_checkpoint": (False, "elastic checkpoints", "no effect", "no effect on training"),
    "legacy_stage1": (False, "the legacy stage 1 implementation", "no effect", ROUNDING),
    "use_multi_rank_bucket_allreduce": (True, "bucket all-reduce variant", "no effect", _COMM),
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning", "no effect", _COMM),
    "zero_quantized_weights": (False, "ZeRO++ quantized weight all-gather", "refuse", "full-precision all-gather"),
    "zero_quantized_nontrainable_weights": (False, "quantized frozen weights", "refuse", "full-precision weights"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized gradients", "refuse", "full-precision gradients"),
    "mics_shard_size": (-1, "MiCS sharding groups", "no effect", _COMM),
    "mics_hierarchical_params_gather": (False, "MiCS hierarchical gather", "no effect", _COMM),
    "memory_efficient_linear": (True, "ZeRO-3's linear layer variant", "no effect", ROUNDING),
    "stage3_model_persistence_threshold": (None, "a model-wide persistence limit", "no effect", _COMM),
    "stage3_module_granularity_threshold": (0, "module-granularity prefetch", "no effect", _COMM),
    "stage3_use_all_reduce_for_fetch_params": (False, "all-reduce to fetch parameters", "no effect", _COMM),
    "stage3_allgather_sequential": (False, "sequential all-gather", "no effect", _COMM),
    "pipeline_loading_checkpoint": (False, "pipelined checkpoint loading", "no effect", "no effect on training"),
    "override_module_apply": (True, "module.apply override", "no effect", "no effect on training"),
    "log_trace_cache_warnings": (False, "trace cache warnings", "no effect", "no effect on training"),
    "enable_sanity_checks": (False, "sanity checks", "no effect", "no effect on training"),
    "parameter_alignment": (False, "parameter alignment", "no effect", _COMM),
    "compute_grad_norm": (True, "skips the gradient norm", "refuse", "the norm is computed (clipping works)"),
    "zenflow": (None, "ZenFlow asynchronous optimizer updates", "refuse", "synchronous updates"),
    "leaf_module": ({}, "leaf modules for ZeRO-3", "no effect", _COMM),
    "zeropp_loco_param": (None, "ZeRO++ LoCo error feedback", "refuse", "no error feedback"),
}


def _offload(sink: Sink, key: str, name: str, value: object) -> None:
    block = to_mapping(sink, key, value)
    if block is None:
        return
    target = "zero.offload_optimizer" if name == "offload_optimizer" else "zero.offload_params"
    device = str(block.get("device", "none")).lower()
    for sub, v in block.items():
        k = f"{key}.{sub}"
        if sub == "device":
            if device in ("none", "cpu", "nvme"):
                sink.map(k, target, device)
            else:
                sink.problem(k, f"must be none, cpu or nvme; got {fmt(v)}")
        elif device == "none":
            sink.no_effect(k, "no offload: DeepSpeed ignores it", "no effect on training")
        elif sub == "pin_memory":
            if is_auto(v):
                sink.map(k, "zero.pin_memory", "auto", "not filled by HF: ftkit's rule decides")
            elif (b := to_bool(sink, k, v)) is not None:
                sink.map(k, "zero.pin_memory", b)
        elif sub == "nvme_path":
            if (s := to_str(sink, k, v)) is not None:
                sink.map(k, "zero.nvme_path", s)
        elif sub == "ratio":
            f = to_float(sink, k, v, minimum=0)
            if f == 1.0:
                sink.same(k, "everything offloaded (DeepSpeed's default)")
            elif f is not None:
                sink.no_effect(k, f"partial offload ({fmt(f)})", "ftkit offloads all optimizer states: same update")
        elif sub in ("buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline_read", "pipeline_write"):
            sink.no_effect(k, "offload buffer tuning", "speed and memory only; same update")
        elif sub in ("pipeline", "super_offload", "cpuadam_cores_perc"):
            sink.no_effect(k, "offload pipelining", "speed only; same update")
        else:
            sink.unknown(k, v, f"DeepSpeed {name}")
    if "device" not in block:
        sink.problem(key, "has no device (none, cpu or nvme)")


# ---------------------------------------------------------------------------------------------------------------
# Canonical form, for comparing two configs


def canonical(cfg: Mapping[str, object]) -> dict[str, object]:
    """``cfg`` flattened to dotted keys in the spelling ftkit renders: zero aliases and deprecated spellings folded
    in, ``bfloat16`` as ``bf16``, numbers as ints when whole, ``"true"``/``"false"`` as booleans, the optimizer type
    lower-cased (``adam`` with adam_w_mode is ``adamw``), an offload block with device none dropped."""
    out: dict[str, object] = {}

    def put(key: str, value: object) -> None:
        out[key] = _norm(value)

    for key, value in cfg.items():
        key = "bf16" if key == "bfloat16" else str(key)
        if key.startswith("_"):
            continue
        if key == "zero_optimization" and isinstance(value, dict):
            for sub, v in value.items():
                name = ZERO_ALIASES.get(str(sub), str(sub))
                if name == "cpu_offload":
                    if _norm(v) is True:
                        put("zero_optimization.offload_optimizer.device", "cpu")
                    continue
                if name in ("cpu_offload_param", "cpu_offload_params"):
                    if _norm(v) is True:
                        put("zero_optimization.offload_param.device", "cpu")
                    continue
                if isinstance(v, dict) and name in ("offload_optimizer", "offload_param"):
                    if str(v.get("device", "none")).lower() == "none":
                        continue
                    for k2, v2 in v.items():
                        put(f"zero_optimization.{name}.{k2}", v2)
                    continue
                put(f"zero_optimization.{name}", v)
        elif key == "sequence_parallel" and isinstance(value, dict) and str(value.get("mode", "ulysses")) == "ulysses":
            # LLaMA-Factory's block: what DeepSpeed reads as sequence_parallel_size (when enabled)
            if _norm(value.get("enabled", True)) is not False and _norm(value.get("size", 1)) not in (1, None):
                put("sequence_parallel_size", value.get("size"))
        elif isinstance(value, dict) and key not in ("scheduler",):
            for sub, v in _flatten(value, key).items():
                put(sub, v)
        elif key == "scheduler" and isinstance(value, dict):
            for sub, v in _flatten(value, key).items():
                put(sub, v)
        else:
            put(key, value)
    kind = out.get("optimizer.type")
    if isinstance(kind, str):
        kind = kind.lower()
        if kind == "adam" and out.get("optimizer.params.adam_w_mode", True) is True:
            kind = "adamw"
        out["optimizer.type"] = kind
        out.pop("optimizer.params.adam_w_mode", None)
    if isinstance(scheduler := out.get("scheduler.type"), str):
        out["scheduler.type"] = scheduler.lower()
    return out


def canonical_key(key: str) -> str:
    """A dotted key as a source spells it, in :func:`canonical`'s spelling (zero aliases, ``bfloat16``)."""
    parts = key.split(".")
    if parts[0] == "bfloat16":
        parts[0] = "bf16"
    if parts[0] == "zero_optimization" and len(parts) > 1:
        parts[1] = ZERO_ALIASES.get(parts[1], parts[1])
    return ".".join(parts)


def _flatten(value: Mapping[str, object], prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in value.items():
        key = f"{prefix}.{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _norm(value: object) -> object:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        if low == "auto":
            return "auto"
        try:
            return _norm(float(value))
        except ValueError:
            return value
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return int(value)
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


def stage_of(flat: Mapping[str, object]) -> int:
    stage = flat.get("zero_optimization.stage", 0)
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else 0


def relevant(key: str, flat: Mapping[str, object]) -> str | None:
    """None when ``key`` matters in a config like ``flat``; else why DeepSpeed ignores it there."""
    stage = stage_of(flat)
    if key.startswith("zero_optimization.") and key != "zero_optimization.stage":
        name = key.split(".")[1]
        if stage == 0:
            return "DeepSpeed ignores it at stage 0"
        if name in STAGE12_ONLY and stage == 3:
            return "DeepSpeed ignores it at stage 3"
        if name in STAGE3_ONLY and stage < 3:
            return f"DeepSpeed uses it only at stage 3 (stage {stage})"
    if key.startswith("fp16.") and key != "fp16.enabled" and flat.get("fp16.enabled") is not True:
        return "fp16 is off"
    if key.startswith("bf16.") and key != "bf16.enabled":
        return "DeepSpeed's bf16 has no loss scaling"
    return None
