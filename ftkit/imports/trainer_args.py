"""HF TrainingArguments -> claims: a JSON/YAML of arguments, or a saved command line with its launcher.

The launcher part of a command line (``torchrun --nproc_per_node 8 --nnodes 2``, ``deepspeed --num_gpus 8
--hostfile H``, ``accelerate launch --num_processes 16 --config_file A``) gives the world size HF's
``args.world_size`` is; ``--deepspeed FILE`` and ``--config_file FILE`` are read as sources too. The arguments
table (:data:`ARGUMENTS`) is shared with LLaMA-Factory, whose YAML is TrainingArguments plus its own keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ftkit.imports import fsdp as fsdp_source
from ftkit.imports.mapping import ACCUM, BF16, FP16, MICRO, NODES, TA_OPTIM, WORLD, Sink, fmt
from ftkit.imports.read import Command
from ftkit.imports.values import to_bool, to_float, to_int, to_str, unset
from ftkit.rundir.records import JSONScalar

if TYPE_CHECKING:  # pragma: no cover
    from ftkit.imports.build import Context

# (sink, key, the value as the source writes it, all the source's arguments, context); what it returns is ignored
Handler = Callable[[Sink, str, object, Mapping[str, object], "Context"], object]
ROUNDING = "same update up to floating-point rounding"
NONE = "no effect on training"


def _int(target: str, minimum: int = 0) -> Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if (v := to_int(sink, key, value, minimum=minimum)) is not None:
            sink.map(key, target, v, origin="ta")

    return h


def _float(target: str, minimum: float = 0) -> Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if (v := to_float(sink, key, value, minimum=minimum)) is not None:
            sink.map(key, target, v, origin="ta")

    return h


def _bool(target: str) -> Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if (v := to_bool(sink, key, value)) is not None:
            sink.map(key, target, v, origin="ta")

    return h


def _none(why: str, effect: str = NONE) -> Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        sink.no_effect(key, why, effect)

    return h


def _default_or(default: JSONScalar, why: str, effect: str, refuse: bool = True) -> Handler:
    """Equal to TrainingArguments' default: nothing to carry; another value: refused (or not carried)."""

    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if _same(value, default):
            sink.same(key, f"TrainingArguments' default ({fmt(default)}), what ftkit's run uses")
        elif refuse:
            sink.refuse(key, f"{why} ({_shown(key, value)})", effect)
        else:
            sink.no_effect(key, f"{why} ({_shown(key, value)})", effect)

    return h


def _same(value: object, default: JSONScalar) -> bool:
    if unset(value) and unset(default):
        return True
    if isinstance(default, bool):
        return str(value).lower() == str(default).lower()
    if isinstance(default, (int, float)):
        number = _number(value)
        return number is not None and number == float(default)
    return str(value).lower() == str(default).lower()


def _shown(key: str, value: object) -> str:
    return "value hidden" if any(s in key.lower() for s in ("token", "secret", "password", "key")) else fmt(value)


def _epochs(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if (v := to_float(sink, key, value, minimum=0)) is None:
        return
    steps = _get(args, "max_steps")
    if steps is not None and _positive(steps):
        sink.no_effect(key, "max_steps is set: HF trains by steps", NONE)
    else:
        sink.map(key, "train.epochs", v, origin="ta")


def _max_steps(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if (v := to_int(sink, key, value, minimum=-1)) is None:
        return
    if v <= 0:
        sink.same(key, "unset (-1): trains by num_train_epochs")
    else:
        sink.map(key, "train.max_steps", v, origin="ta")


def _number(value: object) -> float | None:
    """``float(value)``, or None where float() refuses the value (TypeError, ValueError)."""
    if not isinstance(value, (str, bytes, int, float)):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _positive(value: object) -> bool:
    number = _number(value)
    return number is not None and number > 0


def _get(args: Mapping[str, object], name: str) -> object:
    return args.get(name, args.get(name.replace("_", "-")))


SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def _scheduler(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    name = to_str(sink, key, value)
    if name is None:
        return
    if name.lower() in SCHEDULES:
        sink.map(key, "train.lr_scheduler", name.lower(), origin="ta")
    else:
        c = sink.refuse(key, f"schedule {name}: ftkit has {', '.join(SCHEDULES)}", "accepted: cosine")
        c.target, c.value, c.origin = "train.lr_scheduler", "cosine", "ta"


def _warmup(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    """warmup_steps (an int, or in transformers 5 a float below 1: a ratio) and the older warmup_ratio."""
    v = to_float(sink, key, value, minimum=0)
    if v is None:
        return
    ratio = key.lstrip("-").startswith("warmup_ratio") or 0 < v < 1
    if not ratio:
        if v.is_integer():
            sink.map(key, "train.warmup_steps", int(v), origin="ta")
        else:
            sink.problem(key, f"expected whole steps (or a ratio below 1), got {v}")
        return
    if v == 0:
        sink.same(key, "no warm-up")
        return
    steps = _get(args, "max_steps")
    if steps is not None and (total := _number(steps)) is not None and total > 0:
        n = math.ceil(total * v)
        sink.map(
            key, "train.warmup_steps", n, f"ratio {fmt(v)} x max_steps {fmt(steps)}, rounded up as HF does", origin="ta"
        )
    else:
        c = sink.refuse(
            key,
            f"a warm-up ratio ({fmt(v)}) of a run measured in epochs: ftkit needs train.warmup_steps",
            "accepted: no warm-up until you set train.warmup_steps",
        )
        c.target, c.value, c.origin = "train.warmup_steps", 0, "ta"


def _report_to(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    items = value if isinstance(value, list) else [x for x in str(value).replace(",", " ").split() if x]
    items = [str(x).lower() for x in items]
    if items in ([], ["none"]):
        sink.map(key, "train.report_to", [], origin="ta")
        return
    if items == ["all"]:
        sink.no_effect(key, "all installed integrations: ftkit needs them named (train.report_to)", NONE)
        return
    kept = [x for x in items if x in ("tensorboard", "wandb", "mlflow")]
    if kept:
        sink.map(key, "train.report_to", kept, origin="ta")
    if len(kept) < len(items):
        sink.no_effect(key, f"reporting to {', '.join(x for x in items if x not in kept)}: not supported", NONE)


def _output_dir(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if (s := to_str(sink, key, value)) is not None:
        sink.map(key, "train.output_dir", ctx.path_value(s), "the run directory", origin="ta")


def _run_name(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    import re

    s = str(value)
    if re.fullmatch(r"[A-Za-z0-9._-]{1,64}", s):
        sink.map(key, "name", s, origin="ta")
    else:
        sink.no_effect(key, "not a valid ftkit run name (letters, digits, '.', '_', '-')", NONE)


def _deepspeed(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if isinstance(value, dict):
        ctx.inline_deepspeed(sink, key, value)
    elif not unset(value):
        ctx.follow(sink, key, str(value), "deepspeed")
    else:
        sink.same(key, "no DeepSpeed config named")


def _fsdp_off(value: object) -> bool:
    return unset(value) or value is False or str(value).strip().lower() in ("", "false", "none", "[]")


def _fsdp(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    """``fsdp: "full_shard auto_wrap"``: HF builds Accelerate's FSDP plugin from it and fsdp_config."""
    if _fsdp_off(value):
        sink.same(key, "FSDP off")
    else:
        config = _get(args, "fsdp_config")
        fsdp_source.options(sink, key, value, fsdp_source.fsdp_version(config if isinstance(config, dict) else {}))


def _fsdp_config(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value):
        sink.same(key, "unset")
    elif _fsdp_off(_get(args, "fsdp")):
        sink.no_effect(key, "HF reads fsdp_config only with fsdp set", NONE)
    elif isinstance(value, dict):
        words = str(_get(args, "fsdp")).replace(",", " ").replace("'", " ").lower().split()
        wrap = fsdp_source.WRAP if "auto_wrap" in words else None  # HF wraps by layer class with auto_wrap
        defaults = {**fsdp_source.ENVIRONMENT, "auto_wrap_policy": wrap}
        fsdp_source.read(sink, key, value, fsdp_source.fsdp_version(value), defaults)
    else:
        sink.refuse(key, f"FSDP settings in a file ({fmt(value)}): ftkit reads fsdp_config written inline",
                    "FSDP2 with ftkit's defaults (fsdp.*)")  # fmt: skip


def _hard(why: str) -> Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if unset(value) or str(value).lower() in ("false", "0", "none", "no"):
            sink.same(key, "unset")
        else:
            sink.hard(key, why)

    return h


def _use_cpu(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if (b := to_bool(sink, key, value)) is not None:
        sink.map(key, "cluster.accelerator", "cpu" if b else "cuda", origin="ta")


def _data_seed(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    seed = _get(args, "seed")
    if unset(value) or (seed is not None and str(value) == str(seed)):
        sink.same(key, "ftkit sets data_seed = train.seed")
    else:
        sink.refuse(key, f"data_seed {fmt(value)} unlike seed: ftkit sets data_seed = train.seed", "another data order")


def _gc(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value):
        sink.same(key, "unset")
    elif (b := to_bool(sink, key, value)) is not None:
        sink.map(key, "model.gradient_checkpointing", b, origin="ta")


def _eval_steps(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value):
        sink.same(key, "unset")
    elif (v := to_float(sink, key, value, minimum=0)) is not None and v.is_integer() and v >= 1:
        sink.map(key, "train.eval_steps", int(v), "evaluates only when data.eval names a file", origin="ta")
    else:
        sink.no_effect(key, "an evaluation interval as a ratio: set train.eval_steps", NONE)


def _cadence(target: str) -> Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        v = to_float(sink, key, value, minimum=0)
        if v is not None and v.is_integer() and v >= 1:
            sink.map(key, target, int(v), origin="ta")
        elif v is not None:
            sink.no_effect(key, f"an interval as a ratio of the run: set {target}", NONE)

    return h


def _save_total_limit(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value) or str(value).lower() == "none":
        sink.no_effect(key, "keep every checkpoint: ftkit keeps train.save_total_limit committed ones", NONE)
    elif (v := to_int(sink, key, value, minimum=1)) is not None:
        sink.map(key, "train.save_total_limit", v, origin="ta")


def _refuse_set(why: str, effect: str) -> Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if unset(value):
            sink.same(key, "unset")
        else:
            sink.refuse(key, f"{why} ({_shown(key, value)})", effect)

    return h


def _train_file(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    text = str(value)
    if text.rsplit(".", 1)[-1].lower() in ("jsonl", "json", "csv", "parquet", "txt"):
        sink.map(key, "data.train", ctx.path_value(text), "fields text, prompt+completion or messages", origin="ta")
    else:
        sink.refuse(key, f"training data {text}: ftkit reads jsonl/json/csv/parquet/txt", DATA)


def _eval_file(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value):
        sink.same(key, "unset")
    else:
        sink.map(key, "data.eval", ctx.path_value(str(value)), origin="ta")


DATA = "convert it to a local jsonl (text, prompt+completion or messages fields) and set data.train"
_LOG = "logging, saving, evaluation or hub plumbing"
_DATA = "data loading"

ARGUMENTS: dict[str, Handler] = {
    "per_device_train_batch_size": _int(MICRO, 1),
    "gradient_accumulation_steps": _int(ACCUM, 1),
    "learning_rate": _float("train.learning_rate"),
    "weight_decay": _float("train.weight_decay"),
    "adam_beta1": _float("train.adam_beta1"),
    "adam_beta2": _float("train.adam_beta2"),
    "adam_epsilon": _float("train.adam_epsilon"),
    "max_grad_norm": _float("train.max_grad_norm"),
    "num_train_epochs": _epochs,
    "max_steps": _max_steps,
    "lr_scheduler_type": _scheduler,
    "lr_scheduler_kwargs": _default_or(None, "scheduler arguments", "the schedule's defaults"),
    "warmup_steps": _warmup,
    "warmup_ratio": _warmup,
    "optim": lambda sink, key, value, args, ctx: sink.map(key, TA_OPTIM, str(value), origin="ta"),
    "optim_args": _default_or(None, "optimizer arguments", "AdamW's defaults"),
    "optim_target_modules": _default_or(None, "optimizer target modules", "every trainable parameter"),
    "bf16": _bool(BF16),
    "fp16": _bool(FP16),
    "bf16_full_eval": _default_or(False, "bf16 evaluation (HF also enables bf16 in the DeepSpeed config)", "fp32 eval"),
    "fp16_full_eval": _default_or(False, "fp16 evaluation (HF also enables fp16 in the DeepSpeed config)", "fp32 eval"),
    "tf32": _none("TF32 matmuls: ftkit leaves PyTorch's default", ROUNDING),
    "half_precision_backend": _none("mixed-precision backend: DeepSpeed's under ftkit", ROUNDING),
    "fp16_backend": _none("mixed-precision backend: DeepSpeed's under ftkit", ROUNDING),
    "fp16_opt_level": _none("apex opt level: not used under DeepSpeed", NONE),
    "gradient_checkpointing": _gc,
    "gradient_checkpointing_kwargs": _none("checkpointing variant (use_reentrant)", ROUNDING),
    "activation_checkpointing": _default_or(None, "activation checkpointing", "model.gradient_checkpointing"),
    "activation_checkpointing_kwargs": _none("checkpointing variant", ROUNDING),
    "output_dir": _output_dir,
    "logging_steps": _cadence("train.logging_steps"),
    "save_steps": _cadence("train.save_steps"),
    "save_total_limit": _save_total_limit,
    "seed": _int("train.seed"),
    "data_seed": _data_seed,
    "report_to": _report_to,
    "run_name": _run_name,
    "eval_steps": _eval_steps,
    "deepspeed": _deepspeed,
    "fsdp": _fsdp,
    "fsdp_config": _fsdp_config,
    "use_cpu": _use_cpu,
    "no_cuda": _use_cpu,
    "torch_compile": _default_or(False, "torch.compile: ftkit does not compile", ROUNDING + "; slower", False),
    "torch_compile_backend": _none("torch.compile backend", ROUNDING),
    "torch_compile_mode": _none("torch.compile mode", ROUNDING),
    "use_liger_kernel": _default_or(False, "Liger kernels", ROUNDING + "; more memory", False),
    "liger_kernel_config": _none("Liger kernels", ROUNDING),
    "full_determinism": _default_or(False, "deterministic algorithms", "PyTorch's default kernels"),
    "label_smoothing_factor": _default_or(0.0, "label smoothing", "plain cross-entropy"),
    "neftune_noise_alpha": _default_or(None, "NEFTune embedding noise", "no noise"),
    "auto_find_batch_size": _default_or(False, "halving the batch on out-of-memory", "a fixed micro batch"),
    "group_by_length": _default_or(False, "batches grouped by length", "random batches"),
    "train_sampling_strategy": _default_or("random", "another sampling order", "random order"),
    "dataloader_drop_last": _default_or(False, "dropping the last partial batch", "the last batch is kept"),
    "average_tokens_across_devices": _default_or(True, "per-device loss averaging", "tokens averaged over ranks"),
    "accelerator_config": _default_or(None, "Accelerate's batch splitting/dispatching", "Accelerate's defaults"),
    "parallelism_config": _default_or(None, "tensor/context parallelism", "data parallelism only"),
    "split_batches": _default_or(False, "splitting one batch over ranks", "a batch per rank"),
    "dispatch_batches": _none(_DATA, NONE),
    # the model and data arguments of HF's example scripts (run_clm.py and friends) and TRL's SFTConfig
    "model_name_or_path": lambda sink, key, value, args, ctx: sink.map(
        key, "model.path", ctx.path_value(str(value), hub=True), origin="ta"
    ),
    "tokenizer_name": lambda sink, key, value, args, ctx: sink.map(
        key, "model.tokenizer", ctx.path_value(str(value), hub=True), origin="ta"
    ),
    "train_file": _train_file,
    "validation_file": _eval_file,
    "dataset_name": _refuse_set("a hub dataset", DATA),
    "dataset_config_name": _none("the hub dataset's configuration", NONE),
    "validation_split_percentage": _refuse_set("holds out part of the training data", "all of it trains"),
    "max_train_samples": _refuse_set("uses only the first examples", "every example trains"),
    "max_eval_samples": _none("evaluation size", NONE),
    "block_size": _int("data.max_seq_len", 1),
    "cache_dir": _none("where models are cached", NONE),
    "model_revision": lambda sink, key, value, args, ctx: sink.map(key, "model.revision", str(value), origin="ta"),
    "use_fast_tokenizer": _none("tokenizer implementation", NONE),
    "torch_dtype": _none("the dtype the weights load in: DeepSpeed's precision decides training", NONE),
    "low_cpu_mem_usage": _none("model loading", NONE),
    "trust_remote_code": _none("remote code loading", NONE),
    "preprocessing_num_workers": _none("data preprocessing", NONE),
    "overwrite_cache": _none("data cache", NONE),
    "keep_linebreaks": _none("text data detail", NONE),
    "max_seq_length": _int("data.max_seq_len", 1),
    "max_length": _int("data.max_seq_len", 1),
    "tpu_num_cores": _hard("TPU settings: ftkit runs on CUDA GPUs or CPUs"),
    "xpu_backend": _hard("XPU settings: ftkit runs on CUDA GPUs or CPUs"),
    "use_mps_device": _hard("Apple MPS: ftkit runs on CUDA GPUs or CPUs"),
    "use_ipex": _default_or(False, "Intel extension", ROUNDING, False),
    "save_only_model": _default_or(False, "model-only checkpoints: ftkit saves full ones so runs resume", NONE, False),
    "resume_from_checkpoint": _default_or(None, "ftkit resumes from the newest committed checkpoint", NONE, False),
    "save_strategy": _default_or("steps", "another save cadence: ftkit saves every train.save_steps", NONE, False),
}
for _name in (
    "do_train do_eval do_predict overwrite_output_dir logging_dir logging_strategy logging_first_step log_level "
    "log_level_replica log_on_each_node logging_nan_inf_filter disable_tqdm skip_memory_metrics "
    "include_num_input_tokens_seen include_tokens_per_second push_to_hub hub_model_id hub_strategy hub_token "
    "hub_private_repo hub_always_push hub_revision push_to_hub_model_id push_to_hub_organization push_to_hub_token "
    "project trackio_space_id trackio_bucket_id trackio_static_space_id eval_strategy evaluation_strategy "
    "per_device_eval_batch_size per_gpu_eval_batch_size eval_accumulation_steps eval_delay eval_on_start "
    "prediction_loss_only eval_do_concat_batches eval_use_gather_object include_for_metrics batch_eval_metrics "
    "include_inputs_for_metrics load_best_model_at_end metric_for_best_model greater_is_better "
    "save_on_each_node save_safetensors enable_jit_checkpoint restore_callback_states_from_checkpoint "
    "ignore_data_skip debug local_rank ddp_timeout ddp_backend ddp_find_unused_parameters ddp_bucket_cap_mb "
    "ddp_broadcast_buffers ddp_static_graph dataloader_num_workers dataloader_pin_memory "
    "dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context "
    "dataloader_in_order remove_unused_columns label_names length_column_name torch_empty_cache_steps use_cache "
    "past_index jit_mode_eval tpu_metrics_debug use_legacy_prediction_loop ray_scope mp_parameters "
    "torchdynamo eval_steps_ratio _n_gpu deepspeed_plugin gradient_checkpointing_use_reentrant "
    "save_strategy_steps per_gpu_train_batch_size hub_private hub_organization"
).split():
    ARGUMENTS.setdefault(_name, _none(_LOG if not _name.startswith("dataloader") else _DATA, NONE))
# per_gpu_train_batch_size is the deprecated spelling of per_device_train_batch_size
ARGUMENTS["per_gpu_train_batch_size"] = _int(MICRO, 1)


def read(
    sink: Sink,
    data: Mapping[str, object] | Command,
    ctx: Context,
    extra: dict[str, Handler] | None = None,
    kind: str = "TrainingArguments",
) -> None:
    """Claims for a TrainingArguments mapping or command line (``extra``: another tool's own keys)."""
    ctx.report.trainer_sources.append(sink.source)
    table = {**ARGUMENTS, **(extra or {})}
    args: Mapping[str, object]
    if isinstance(data, Command):
        _launcher(sink, data, ctx)
        args, dash = data.args, "--"
    else:
        args, dash = data, ""
    for name, value in args.items():
        key = f"{dash}{name}"
        handler = table.get(str(name).lstrip("-"))
        if handler is None:
            sink.unknown(key, value if not any(s in key for s in ("token", "secret")) else "(hidden)", kind)
        else:
            handler(sink, key, value, args, ctx)


# ---------------------------------------------------------------------------------------------------------------
# Launchers


def _launcher(sink: Sink, cmd: Command, ctx: Context) -> None:
    """World size (and other launcher options) from the launcher part of a command line."""
    opts, launcher = cmd.launcher_opts, cmd.launcher or "python"
    if cmd.script:
        sink.no_effect(
            f"{launcher} {cmd.script}",
            "the training script (code, not a setting): the recipe trains with ftkit's built-in entry; set "
            f"train.command to keep running {cmd.script.removeprefix('-m ')} (ftkit applies the recipe's arguments)",
        )
    per = nodes = None
    per_key = nodes_key = ""
    for name, value in opts.items():
        key = f"{launcher} --{name}"
        if name in ("nproc_per_node", "num_gpus", "num_processes"):
            if str(value) in ("gpu", "auto"):
                sink.no_effect(key, "every GPU of the node: ftkit needs the number (cluster.gpus_per_node)", NONE)
            elif (per := to_int(sink, key, value, minimum=1)) is not None:
                per_key = key
        elif name in ("nnodes", "num_nodes", "num_machines"):
            if ":" in str(value):
                sink.refuse(
                    key, f"elastic node range {value}", "a fixed number of nodes (cluster.min_nodes for shrinking)"
                )
            elif (nodes := to_int(sink, key, value, minimum=1)) is not None:
                nodes_key = key
        elif name in ("master_addr", "main_process_ip"):
            sink.map(key, "cluster.master_addr", str(value))
        elif name in ("master_port", "main_process_port"):
            if (p := to_int(sink, key, value, minimum=1)) is not None:
                sink.map(key, "cluster.master_port", p)
        elif name in ("hostfile", "H"):
            ctx.hostfile(sink, key, str(value))
        elif name in ("config_file",) and launcher == "accelerate":
            ctx.follow(sink, key, str(value), "accelerate")
        elif name in ("deepspeed_config_file",):
            ctx.follow(sink, key, str(value), "deepspeed")
        elif name == "mixed_precision":
            m = str(value).lower()
            if m == "fp8":
                sink.hard(key, "fp8 training is not supported by ftkit")
            else:
                sink.map(key, BF16, m == "bf16", origin="ta")
                sink.map(key, FP16, m == "fp16", origin="ta")
        else:
            sink.no_effect(key, "launcher option: ftkit builds the launch command (cluster.engine)", NONE)
    if launcher == "accelerate" and per is not None:  # accelerate's --num_processes counts all processes
        sink.map(per_key, WORLD, per, "accelerate --num_processes: all processes")
        per = None
    if per is not None:
        world = per * (nodes or 1)
        sink.map(per_key, WORLD, world, f"{per} per node x {nodes or 1} node(s)")
    if nodes is not None:
        sink.map(nodes_key, NODES, nodes)
    if launcher == "python" and not opts and cmd.script and not ctx.world_named():
        sink.map(f"python {cmd.script}", WORLD, 1, "a plain python command runs one process")
    lf: dict[str, tuple[str, int]] = {}  # llamafactory-cli's torchrun variables
    for env, value in cmd.env.items():
        key = f"{env}= (environment)"
        if env in ("NPROC_PER_NODE", "NNODES") and cmd.launcher == "llamafactory-cli":
            if (n := to_int(sink, key, value, minimum=1)) is not None:
                lf[env] = (key, n)
        else:
            sink.no_effect(key, "environment of the launch: ftkit sets the ranks' environment", NONE)
    if "NPROC_PER_NODE" in lf:
        (key, per), nodes = lf["NPROC_PER_NODE"], lf.get("NNODES", ("", 1))[1]
        sink.map(key, WORLD, per * nodes, f"{per} per node x {nodes} node(s)")
    if "NNODES" in lf:
        sink.map(lf["NNODES"][0], NODES, lf["NNODES"][1])
