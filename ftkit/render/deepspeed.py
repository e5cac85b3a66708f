"""DeepSpeed config from a Plan: concrete numbers only (never "auto"), so a checked-in file can be reviewed.

The plan decides every value (the rules, with their reasons, in :mod:`ftkit.plan.knobs`; docs/design.md, Rendering
rules); this module only formats ``plan.knobs`` and the recipe's plain values (learning rate, betas...) as DeepSpeed's
JSON. A knob the plan did not record for the chosen stage (round_robin_gradients at stage 3, ZeRO++'s knobs when not
chosen, pin_memory without offload...) is not written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ftkit.plan.plan import Plan


def to_json(cfg: Mapping[str, object]) -> str:
    return json.dumps(cfg, indent=2) + "\n"


def _offload(plan: Plan, device: str, what: str) -> dict[str, object]:
    block: dict[str, object] = {"device": device}
    if device == "nvme":
        block["nvme_path"] = plan.recipe.zero.nvme_path
    block["pin_memory"] = plan.knobs[f"{what}.pin_memory"].value
    return block


def render_deepspeed(plan: Plan) -> dict[str, object]:
    r = plan.recipe
    k = plan.knobs
    cfg: dict[str, object] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": k["gradient_clipping"].value,
        "steps_per_print": 1000000,  # HF Trainer does the logging; keep DeepSpeed's own step prints quiet
        "wall_clock_breakdown": False,
    }
    precision = k["precision"].value
    cfg["bf16"] = {"enabled": precision == "bf16"}
    if precision == "fp16":
        fp16: dict[str, object] = {"enabled": True}  # loss_scale 0 = dynamic loss scaling
        for name in ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale"):
            fp16[name] = k[f"fp16.{name}"].value
        cfg["fp16"] = fp16
    else:
        cfg["fp16"] = {"enabled": False}

    params: dict[str, object] = {
        "lr": r.train.learning_rate,
        "betas": [r["train.adam_beta1"], r["train.adam_beta2"]],
        "eps": r.train.adam_epsilon,
        "weight_decay": r.train.weight_decay,
    }
    for key in ("torch_adam", "fused"):  # torch's (fused) AdamW instead of a DeepSpeed op that needs a build
        if f"optimizer.{key}" in k:
            params[key] = k[f"optimizer.{key}"].value
    cfg["optimizer"] = {"type": k["optimizer"].value, "params": params}
    if "scheduler" in k:  # DeepSpeed's own schedule (HF Trainer hands the block to DeepSpeed)
        prefix = "scheduler."
        cfg["scheduler"] = {
            "type": k["scheduler"].value,
            "params": {name.removeprefix(prefix): v.value for name, v in k.items() if name.startswith(prefix)},
        }

    stage = plan.stage
    z: dict[str, object] = {"stage": stage}
    if stage in (1, 2):
        z["contiguous_gradients"] = k["contiguous_gradients"].value
        z["overlap_comm"] = k["overlap_comm"].value
        z["reduce_scatter"] = True
        z["reduce_bucket_size"] = k["reduce_bucket_size"].value
        z["allgather_partitions"] = True
        z["allgather_bucket_size"] = k["allgather_bucket_size"].value
        z["round_robin_gradients"] = k["round_robin_gradients"].value
        if plan.offload_optimizer != "none":
            z["offload_optimizer"] = _offload(plan, plan.offload_optimizer, "offload_optimizer")
    elif stage == 3:
        z["contiguous_gradients"] = k["contiguous_gradients"].value
        z["overlap_comm"] = k["overlap_comm"].value
        z["reduce_bucket_size"] = k["reduce_bucket_size"].value
        z["stage3_prefetch_bucket_size"] = k["stage3_prefetch_bucket_size"].value
        z["stage3_param_persistence_threshold"] = k["stage3_param_persistence_threshold"].value
        z["stage3_max_live_parameters"] = k["stage3_max_live_parameters"].value
        z["stage3_max_reuse_distance"] = k["stage3_max_reuse_distance"].value
        z["sub_group_size"] = k["sub_group_size"].value
        z["stage3_gather_16bit_weights_on_model_save"] = k["stage3_gather_16bit_weights_on_model_save"].value
        if plan.offload_optimizer != "none":
            z["offload_optimizer"] = _offload(plan, plan.offload_optimizer, "offload_optimizer")
        if plan.offload_params != "none":
            z["offload_param"] = _offload(plan, plan.offload_params, "offload_param")
        # ZeRO++ (the plan chooses it across nodes when the inter-node link is the bottleneck, ftkit.plan.comm)
        for key in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients"):
            if key in k:
                z[key] = k[key].value
    if stage != 3 and "stage3_gather_16bit_weights_on_model_save" in k:  # AutoTP (ftkit.plan.knobs)
        z["stage3_gather_16bit_weights_on_model_save"] = k["stage3_gather_16bit_weights_on_model_save"].value
    cfg["zero_optimization"] = z
    # tensor / sequence parallelism (parallel.tp, parallel.sp; ftkit.plan.parallel)
    if plan.tp > 1:  # DeepSpeed AutoTP: HF Trainer calls deepspeed.tp_model_init with this size
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    if plan.sp > 1:  # read where no Ulysses mpu is passed (zero.Init): its world is then world / sp
        cfg["sequence_parallel_size"] = plan.sp
    if plan.tp * plan.sp > 1:
        # HF Trainer checks train_batch_size against micro x accumulation x world size, DeepSpeed against micro x
        # accumulation x its data-parallel ranks (world / sp with Ulysses): written, one of them refuses the file.
        # Left out, DeepSpeed derives it from the two it is given and HF has nothing to compare.
        del cfg["train_batch_size"]
    if plan.local_tier is not None and plan.num_nodes > 1:
        # the local checkpoint tier: every node writes its own copy of the shared files (ftkit.checkpoint.tiers)
        cfg["checkpoint"] = {"use_node_local_storage": True}
    return cfg
