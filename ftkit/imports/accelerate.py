"""Accelerate config YAML -> claims: the launcher fields, and the DeepSpeed plugin (its config file followed, or its
inline ``deepspeed_config`` keys read as Accelerate builds a DeepSpeed config from them).

Accelerate refuses plugin fields (zero stage, offload devices, gradient accumulation, clipping, mixed precision)
next to a ``deepspeed_config_file``; such a source is reported, not guessed at. ``distributed_type: MULTI_GPU`` (DDP)
and ``NO`` are imported as DeepSpeed without ZeRO (stage 0: the same data-parallel update); FSDP (1 or 2) becomes
``train.backend: fsdp2`` (:mod:`ftkit.imports.fsdp`); TPU, XPU, NPU, HPU and the other device-specific types are
refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ftkit.imports import fsdp
from ftkit.imports.mapping import ACCUM, BF16, FP16, NODES, WORLD, Sink, fmt
from ftkit.imports.values import is_auto, to_bool, to_float, to_int, to_mapping, to_str, unset

if TYPE_CHECKING:  # pragma: no cover
    from ftkit.imports.build import Context

NONE = "no effect on training"
DEVICE_ONLY = (
    "TPU",
    "XLA",
    "MULTI_XPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_HPU",
    "MEGATRON_LM",
)
# plugin fields Accelerate refuses next to deepspeed_config_file (accelerate 1.15 _deepspeed_config_checks)
PLUGIN_FIELDS = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
)
_LAUNCH = "launcher plumbing: ftkit builds the launch command (cluster.*)"


def read(sink: Sink, data: Mapping[str, object], ctx: Context) -> None:
    kind = str(data.get("distributed_type", "DEEPSPEED")).upper()
    ds = ds if isinstance(ds := data.get("deepspeed_config"), dict) else {}
    has_file = bool(ds.get("deepspeed_config_file"))
    if kind == "FSDP" and "fsdp_config" not in data:  # every FSDP setting at accelerate launch's default
        fsdp.read(sink, "fsdp_config", {}, 1, fsdp.ACCELERATE_LAUNCH)
    for key, value in data.items():
        key = str(key)
        if key == "distributed_type":
            _distributed_type(sink, key, kind, value, fsdp.fsdp_version(data.get("fsdp_config") or {}))
        elif key == "deepspeed_config":
            if (block := to_mapping(sink, key, value)) is not None:
                if kind != "DEEPSPEED" and block:
                    sink.no_effect(key, f"Accelerate ignores it with distributed_type {kind}", NONE)
                else:
                    _plugin(sink, block, ctx, has_file)
        elif key == "fsdp_config":
            if kind == "FSDP":
                if (block := to_mapping(sink, key, value)) is not None:
                    fsdp.read(sink, key, block, fsdp.fsdp_version(block), fsdp.ACCELERATE_LAUNCH)
            elif unset(value):
                sink.same(key, "empty")
            else:
                sink.no_effect(key, f"Accelerate ignores it with distributed_type {kind}", NONE)
        elif key == "mixed_precision":
            _mixed_precision(sink, key, value, has_file)
        elif key in ("fp8_config", "megatron_lm_config", "ipex_config", "mpirun_config"):
            if unset(value):
                sink.same(key, "empty")
            elif key == "fp8_config":
                sink.hard(key, "fp8 training (Transformer Engine / MS-AMP) is not supported by ftkit")
            elif key == "megatron_lm_config":
                sink.hard(key, "Megatron-LM parallelism is not supported by ftkit")
            else:
                sink.no_effect(key, _LAUNCH, NONE)
        elif key == "num_processes":
            if is_auto(value) or unset(value):
                sink.same(key, "unset: the world size comes from elsewhere")
            elif (n := to_int(sink, key, value, minimum=1)) is not None:
                sink.map(key, WORLD, n, "all processes of all machines")
        elif key == "num_machines":
            if (n := to_int(sink, key, value, minimum=1)) is not None:
                sink.map(key, NODES, n)
        elif key == "main_process_ip":
            if not unset(value):
                sink.map(key, "cluster.master_addr", str(value))
            else:
                sink.same(key, "unset")
        elif key == "main_process_port":
            if not unset(value) and (p := to_int(sink, key, value, minimum=1)) is not None:
                sink.map(key, "cluster.master_port", p)
            elif unset(value):
                sink.same(key, "unset")
        elif key == "use_cpu":
            if (b := to_bool(sink, key, value)) is not None:
                if b:
                    sink.map(key, "cluster.accelerator", "cpu", "CPU processes (gloo)")
                else:
                    sink.same(key, "GPUs (cluster.accelerator cuda)")
        elif key == "downcast_bf16":
            if str(value).lower() in ("no", "false"):
                sink.same(key, "no downcasting")
            else:
                sink.hard(key, "bf16 downcasting is a TPU setting: ftkit runs on CUDA GPUs or CPUs")
        elif key.startswith("tpu_"):
            if unset(value) or value is False:
                sink.same(key, "no TPU")
            else:
                sink.hard(key, "TPU settings: ftkit runs on CUDA GPUs or CPUs")
        elif key == "gpu_ids":
            if str(value).lower() in ("all", "none", "") or unset(value):
                sink.same(key, "all GPUs")
            else:
                sink.no_effect(key, f"GPUs {value}: select them with `ftkit launch --include HOST:{value}`", NONE)
        elif key == "dynamo_config":
            backend = str((value or {}).get("dynamo_backend", "NO")).upper() if isinstance(value, dict) else "NO"
            if backend == "NO":
                sink.same_each(key, value, "no torch.compile")
            else:
                why = f"torch.compile ({backend}): ftkit does not compile"
                sink.no_effect_each(key, value, why, "same update up to rounding")
        elif key in (
            "compute_environment",
            "machine_rank",
            "main_training_function",
            "rdzv_backend",
            "same_network",
            "debug",
            "enable_cpu_affinity",
            "commands",
            "command_file",
        ):
            sink.no_effect(key, _LAUNCH, NONE)
        elif key == "parallelism_config":
            if unset(value):
                sink.same(key, "empty")
            elif (block := to_mapping(sink, key, value)) is not None:
                _parallelism(sink, key, block, kind)
        else:
            sink.unknown(key, value, "Accelerate")


def _parallelism(sink: Sink, key: str, block: Mapping[str, object], kind: str) -> None:
    """``parallelism_config`` (the keys ``accelerate config`` writes, ``parallelism_config_`` in front): tp_size and
    sp_size map to the parallel section; data-parallel sizes are what ftkit derives (world / (tp x sp)), FSDP2's
    hybrid replicas (HSDP) and context parallelism (ring attention) are refused."""
    values = {str(k).removeprefix("parallelism_config_"): v for k, v in block.items()}
    cp = to_int(sink, f"{key}.parallelism_config_cp_size", values.get("cp_size", 1), minimum=1) or 1
    sp = to_int(sink, f"{key}.parallelism_config_sp_size", values.get("sp_size", 1), minimum=1) or 1
    for raw, item in block.items():
        name, k = str(raw).removeprefix("parallelism_config_"), f"{key}.{raw}"
        if name == "tp_size":
            if (n := to_int(sink, k, item, minimum=1)) is not None:
                if n > 1:
                    how = "tp_size x FSDP2" if kind == "FSDP" else "DeepSpeed AutoTP"
                    sink.map(k, "parallel.tp", n, f"tensor parallelism ({how})")
                else:
                    sink.same(k, "no tensor parallelism")
        elif name == "sp_size":
            if sp > 1:
                sink.map(k, "parallel.sp", sp, "DeepSpeed Ulysses (ALST) sequence parallelism")
            else:
                sink.same(k, "no sequence parallelism")
        elif name == "sp_backend":
            if str(item) == "deepspeed":
                sink.same(k, "DeepSpeed's Ulysses, what parallel.sp runs")
            else:
                sink.refuse(k, f"sequence-parallel backend {item}: ftkit runs DeepSpeed's Ulysses")
        elif name in ("sp_seq_length_is_variable", "sp_seq_length"):
            sink.same(k, "ftkit renders sp_seq_length_is_variable: true (each batch's own length, a multiple of sp)")
        elif name == "sp_attn_implementation":
            sink.same(k, "ftkit passes the model's attention to Ulysses (config.json's flash attention, else sdpa)")
        elif name == "cp_size":
            if cp > 1:
                sink.refuse(
                    k,
                    "context parallelism (ring attention) is not supported by ftkit (parallel.sp: Ulysses is)",
                    "without it: every rank holds whole sequences",
                )
            else:
                sink.same(k, "no context parallelism")
        elif name in ("cp_backend", "cp_comm_strategy"):
            if cp == 1:
                sink.same(k, "used only with cp_size > 1")
            else:
                sink.no_effect(k, "a detail of context parallelism, refused with cp_size", NONE)
        elif name == "dp_replicate_size":
            n = to_int(sink, k, item, minimum=1)
            if n is not None and n > 1 and kind == "FSDP":
                sink.refuse(k, f"{n} FSDP2 replicas (HSDP): ftkit shards over every data-parallel rank")
            elif n is not None:
                sink.same(k, "the data-parallel degree, which ftkit derives: world size / (tp x sp)")
        elif name == "dp_shard_size":
            if to_int(sink, k, item, minimum=1) is not None:
                sink.same(k, "the data-parallel degree, which ftkit derives: world size / (tp x sp)")
        else:
            sink.unknown(k, item, "Accelerate parallelism_config")


def _distributed_type(sink: Sink, key: str, kind: str, value: object, version: int) -> None:
    if kind == "DEEPSPEED":
        sink.same(key, "DeepSpeed, what ftkit runs")
    elif kind in ("MULTI_GPU", "NO"):
        sink.map(key, "zero.stage", 0, f"{value}: {'DDP' if kind == 'MULTI_GPU' else 'one process'} is DeepSpeed "
                 "without ZeRO (stage 0), the same data-parallel update")  # fmt: skip
    elif kind == "MULTI_CPU":
        sink.map(key, "zero.stage", 0, "CPU processes: DeepSpeed without ZeRO on the cpu accelerator")
        sink.map(key, "cluster.accelerator", "cpu")
    elif kind == "FSDP":
        fsdp.backend(sink, key, version)
    elif kind in DEVICE_ONLY:
        sink.hard(key, f"{value}: ftkit runs on CUDA GPUs or CPUs")
    else:
        sink.problem(key, f"unknown distributed_type {fmt(value)}")


def _mixed_precision(sink: Sink, key: str, value: object, has_file: bool) -> None:
    m = str(value).lower()
    if m == "fp8":
        sink.hard(key, "fp8 training is not supported by ftkit")
    elif m not in ("no", "fp16", "bf16", "false", "none"):
        sink.problem(key, f"must be no, fp16, bf16 or fp8; got {fmt(value)}")
    elif has_file:
        sink.problem(key, "Accelerate refuses mixed_precision next to a deepspeed_config_file: set it in the JSON")
    else:
        sink.map(key, BF16, m == "bf16", origin="ta")
        sink.map(key, FP16, m == "fp16", origin="ta")


def _plugin(sink: Sink, ds: Mapping[str, object], ctx: Context, has_file: bool) -> None:
    for sub, value in ds.items():
        key = f"deepspeed_config.{sub}"
        if has_file and sub in PLUGIN_FIELDS:
            sink.problem(key, "Accelerate refuses it next to deepspeed_config_file: set it in the JSON file")
        elif sub == "deepspeed_config_file":
            ctx.follow(sink, key, str(value), "deepspeed")
        elif sub == "zero_stage":
            if (n := to_int(sink, key, value)) is not None and n <= 3:
                sink.map(key, "zero.stage", n)
            elif n is not None:
                sink.problem(key, f"must be 0-3; got {n}")
        elif sub in ("offload_optimizer_device", "offload_param_device"):
            device = str(value).lower()
            target = "zero.offload_optimizer" if "optimizer" in sub else "zero.offload_params"
            if device in ("none", "cpu", "nvme"):
                sink.map(key, target, device)
            else:
                sink.problem(key, f"must be none, cpu or nvme; got {fmt(value)}")
        elif sub in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
            if unset(value) or str(value).lower() == "none":
                sink.same(key, "unset")
            elif (s := to_str(sink, key, value)) is not None:
                sink.map(key, "zero.nvme_path", s)
        elif sub == "gradient_accumulation_steps":
            if is_auto(value):
                sink.auto(key, ACCUM)
            elif (n := to_int(sink, key, value, minimum=1)) is not None:
                sink.map(key, ACCUM, n)
        elif sub == "gradient_clipping":
            if is_auto(value) or unset(value):
                sink.auto(key, "train.max_grad_norm")
            elif (f := to_float(sink, key, value, minimum=0)) is not None:
                sink.map(key, "train.max_grad_norm", f)
        elif sub == "zero3_init_flag":
            sink.no_effect(key, "ftkit sets it at stage 3 (weights partitioned while loading)", "memory at load only")
        elif sub == "zero3_save_16bit_model":
            sink.no_effect(key, "ftkit always gathers 16-bit weights at save (from_pretrained loads the model)", NONE)
        elif sub == "deepspeed_hostfile":
            ctx.hostfile(sink, key, str(value))
        elif sub in ("deepspeed_multinode_launcher", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter"):
            sink.no_effect(
                key, "launcher plumbing: ftkit builds the launch (cluster.engine, --include/--exclude)", NONE
            )
        elif sub == "deepspeed_moe_layer_cls_names":
            sink.refuse(key, "mixture-of-experts leaf modules for ZeRO-3", "default ZeRO-3 partitioning")
        else:
            sink.unknown(key, value, "Accelerate deepspeed_config")
    if not has_file:
        # Accelerate builds the DeepSpeed config from these fields; everything else is "auto" (HF fills it)
        ctx.inline_plugin(sink, ds)
