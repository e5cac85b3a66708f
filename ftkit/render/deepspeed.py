"""DeepSpeed config from a Plan: concrete numbers only (never "auto"), so a checked-in file can be reviewed.

Rules (DESIGN.md §3): the batch triple written in full; bucket sizes from the hidden size; overlap_comm at stage 3
and at 1/2 when the plan has room; contiguous_gradients on; round_robin_gradients only with optimizer offload at
1/2; offload_param only at stage 3; exactly one of bf16/fp16 enabled (both off for fp32); gradient_clipping from
max_grad_norm; stage3_gather_16bit_weights_on_model_save on so HF-loadable weights come out; ZeRO++'s
zero_hpz_partition_size / zero_quantized_weights / zero_quantized_gradients when the plan chose them.
"""

from __future__ import annotations

import json
from typing import Any

from ..plan import Plan


def to_json(cfg: dict[str, Any]) -> str:
    return json.dumps(cfg, indent=2) + "\n"


def _offload(plan: Plan, device: str, what: str) -> dict[str, Any]:
    r = plan.recipe
    block: dict[str, Any] = {"device": device}
    if device == "nvme":
        block["nvme_path"] = r["zero.nvme_path"]
    if r["cluster.accelerator"] == "cpu":
        pin = plan.note(f"{what}.pin_memory", False, "cpu accelerator: there is no device memory to pin for")
    elif plan.memory is not None and getattr(plan.memory, "host_tight", False):
        pin = plan.note(f"{what}.pin_memory", False, "host RAM is tight: pinned buffers cannot be paged out")
    else:
        pin = plan.note(f"{what}.pin_memory", True, "faster host-device copies; host RAM allows it")
    block["pin_memory"] = pin
    return block


def render_deepspeed(plan: Plan) -> dict[str, Any]:
    r = plan.recipe
    k = plan.knobs
    cfg: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": plan.note("gradient_clipping", r["train.max_grad_norm"], "train.max_grad_norm"),
        "steps_per_print": 1000000,  # HF Trainer does the logging; keep DeepSpeed's own step prints quiet
        "wall_clock_breakdown": False,
    }
    precision = r["train.precision"]
    plan.note("precision", precision, "train.precision; TrainingArguments gets the same flag")
    cfg["bf16"] = {"enabled": precision == "bf16"}
    if precision == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic loss scaling
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    else:
        cfg["fp16"] = {"enabled": False}

    params: dict[str, Any] = {
        "lr": r["train.learning_rate"],
        "betas": [r["train.adam_beta1"], r["train.adam_beta2"]],
        "eps": r["train.adam_epsilon"],
        "weight_decay": r["train.weight_decay"],
    }
    if plan.offload_optimizer == "none" and r["cluster.accelerator"] == "cpu":
        # FusedAdam is a CUDA kernel; on the cpu accelerator without offload use torch's AdamW.
        params["torch_adam"] = plan.note("optimizer.torch_adam", True, "cpu accelerator without offload")
    plan.note("optimizer", "AdamW", "DeepSpeed's optimizer (CPU Adam when offloading); params equal TrainingArguments")
    cfg["optimizer"] = {"type": "AdamW", "params": params}

    stage = plan.stage
    z: dict[str, Any] = {"stage": stage}
    if stage in (1, 2):
        z["contiguous_gradients"] = plan.note("contiguous_gradients", True, "always: less fragmentation")
        z["overlap_comm"] = k["overlap_comm"].value
        z["reduce_scatter"] = True
        z["reduce_bucket_size"] = k["reduce_bucket_size"].value
        z["allgather_partitions"] = True
        z["allgather_bucket_size"] = k["allgather_bucket_size"].value
        z["round_robin_gradients"] = plan.note(
            "round_robin_gradients",
            plan.offload_optimizer != "none",
            "on only with optimizer offload at stage 1/2" if plan.offload_optimizer != "none" else "no offload",
        )
        if plan.offload_optimizer != "none":
            z["offload_optimizer"] = _offload(plan, plan.offload_optimizer, "offload_optimizer")
    elif stage == 3:
        z["contiguous_gradients"] = plan.note("contiguous_gradients", True, "always: less fragmentation")
        z["overlap_comm"] = k["overlap_comm"].value
        z["reduce_bucket_size"] = k["reduce_bucket_size"].value
        z["stage3_prefetch_bucket_size"] = k["stage3_prefetch_bucket_size"].value
        z["stage3_param_persistence_threshold"] = k["stage3_param_persistence_threshold"].value
        z["stage3_max_live_parameters"] = k["stage3_max_live_parameters"].value
        z["stage3_max_reuse_distance"] = k["stage3_max_reuse_distance"].value
        z["sub_group_size"] = plan.note("sub_group_size", int(1e9), "1e9")
        z["stage3_gather_16bit_weights_on_model_save"] = plan.note(
            "stage3_gather_16bit_weights_on_model_save", True, "the final model must load with from_pretrained"
        )
        if plan.offload_optimizer != "none":
            z["offload_optimizer"] = _offload(plan, plan.offload_optimizer, "offload_optimizer")
        if plan.offload_params != "none":
            z["offload_param"] = _offload(plan, plan.offload_params, "offload_param")
        # ZeRO++ (the plan chooses it across nodes when the inter-node link is the bottleneck, ftkit.comm)
        for key in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients"):
            if key in k:
                z[key] = k[key].value
    cfg["zero_optimization"] = z
    return cfg
