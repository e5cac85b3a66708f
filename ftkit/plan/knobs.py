"""Every knob the rendered configs carry, decided in one place with its reason (docs/design.md, Rendering rules).

:func:`decide_zero_knobs` and :func:`decide_config_knobs` run inside :func:`ftkit.plan.plan.build_plan`, after the stage
and offload are resolved, and record each value with the rule or source that produced it in ``plan.knobs``. The
renderers (:mod:`ftkit.render`) only format ``plan.knobs``; ``ftkit explain`` prints them without rendering
anything. :func:`overlap_comm_auto` and :func:`persistence_threshold` are also what the step-time prediction of
each candidate uses (:mod:`ftkit.plan.candidates`), so the plan and the prediction apply the same rules.

Rules: the batch triple written in full (:mod:`ftkit.plan.plan`); bucket sizes from the hidden size; overlap_comm at
stage 3 and at 1/2 when the plan has room; contiguous_gradients on; round_robin_gradients only with optimizer offload at
1/2; offload_param only at stage 3; exactly one of bf16/fp16 enabled (both off for fp32); gradient_clipping from
max_grad_norm; stage3_gather_16bit_weights_on_model_save on so HF-loadable weights come out; pinned offload buffers
unless on the cpu accelerator or host RAM is tight; ZeRO++'s knobs only when ``auto`` chose them
(:func:`ftkit.plan.plan.note_zeropp`).
"""

from __future__ import annotations

from collections.abc import Callable

from ftkit.plan.types import KnobValue, Plan
from ftkit.recipe.load import Recipe
from ftkit.recipe.rules import SCHEDULER_PARAMS
from ftkit.recipe.schema import DEEPSPEED_SCHEDULES

SUB_GROUP_SIZE = int(1e9)
# fp16's dynamic loss scaling: (knob, value, why) for each train.fp16_* field left at auto
FP16_LOSS_SCALING = (
    ("loss_scale", 0, "0: dynamic loss scaling"),
    ("loss_scale_window", 1000, "1000 steps without overflow before the scale doubles (DeepSpeed's default)"),
    ("initial_scale_power", 16, "start at 2^16 (DeepSpeed's default)"),
    ("hysteresis", 2, "DeepSpeed's default"),
    ("min_loss_scale", 1, "DeepSpeed's default"),
)


def overlap_comm_auto(stage: int, room: bool) -> tuple[bool, str]:
    """``zero.overlap_comm: auto``: on at stage 3, off at 0, at 1/2 when memory has room for the extra buckets."""
    if stage == 3:
        return True, "auto: always on at stage 3"
    if stage == 0:
        return False, "auto: nothing to overlap at stage 0"
    if room:
        return True, "auto: the plan has room for the extra bucket buffers"
    return False, "auto: not enough memory headroom for the extra bucket buffers"


def persistence_threshold(hidden_size: int) -> int:
    """``stage3_param_persistence_threshold``: parameters smaller than this stay gathered at stage 3."""
    return 10 * hidden_size


def decide_zero_knobs(plan: Plan, src: Callable[[Recipe, str], str]) -> None:
    """Bucket sizes, overlap and ZeRO-3's live/reuse limits, from the hidden size and the memory plan."""
    r = plan.recipe
    report = plan.memory
    h = plan.hidden_size
    if r.zero.reduce_bucket_size == "auto":
        plan.note("reduce_bucket_size", h * h, f"hidden_size^2 = {h}^2")
    else:
        plan.note("reduce_bucket_size", r.zero.reduce_bucket_size, src(r, "zero.reduce_bucket_size"))
    tight = report.tight if report is not None else False
    if r.zero.allgather_bucket_size == "auto":
        if tight:
            plan.note("allgather_bucket_size", int(2e8), "2e8: memory is tight at the chosen stage (ftkit plan)")
        else:
            plan.note("allgather_bucket_size", int(5e8), "5e8: DeepSpeed's default, memory allows it")
    else:
        plan.note("allgather_bucket_size", r.zero.allgather_bucket_size, src(r, "zero.allgather_bucket_size"))
    oc = r.zero.overlap_comm
    if oc == "auto":
        plan.note("overlap_comm", *overlap_comm_auto(plan.stage, report is not None and report.room_for_overlap))
    else:
        plan.note("overlap_comm", oc, src(r, "zero.overlap_comm"))
    prefetch, persist = int(0.9 * h * h), persistence_threshold(h)
    why = f"int(0.9 x hidden_size^2) = int(0.9 x {h}^2)"
    _rule_or_recipe(plan, "stage3_prefetch_bucket_size", "zero.prefetch_bucket_size", prefetch, why, src)
    why = f"10 x hidden_size = 10 x {h}"
    _rule_or_recipe(plan, "stage3_param_persistence_threshold", "zero.param_persistence_threshold", persist, why, src)
    live = int(1e9) if not tight else int(1e8)
    why = "1e9" if not tight else "1e8: memory is tight"
    _rule_or_recipe(plan, "stage3_max_live_parameters", "zero.max_live_parameters", live, why, src)
    _rule_or_recipe(plan, "stage3_max_reuse_distance", "zero.max_reuse_distance", live, why, src)


def _rule_or_recipe(
    plan: Plan, knob: str, key: str, rule: KnobValue, why: str, src: Callable[[Recipe, str], str] | None = None
) -> None:
    """The recipe's value of an ``auto``-defaulted field when it sets one (e.g. kept by ``ftkit import``), else the
    rule's value."""
    value = plan.recipe[key]
    if value == "auto":
        plan.note(knob, rule, why)
    else:
        plan.note(knob, value, src(plan.recipe, key) if src else key)


def decide_config_knobs(plan: Plan) -> None:
    """The rest of ds_config.json and accelerate.yaml: clipping, precision, optimizer, per-stage ZeRO flags,
    pinned offload buffers, zero3_init_flag. Only the knobs the chosen stage renders are recorded."""
    r = plan.recipe
    plan.note("gradient_clipping", r.train.max_grad_norm, "train.max_grad_norm")
    plan.note("precision", r.train.precision, "train.precision; TrainingArguments gets the same flag")
    if r.train.precision == "fp16":
        for name, rule, why in FP16_LOSS_SCALING:
            _rule_or_recipe(plan, f"fp16.{name}", f"train.fp16_{name}", rule, why)
    decide_optimizer(plan)
    decide_scheduler_knobs(plan)
    offload = plan.offload_optimizer != "none"
    if plan.stage != 3 and plan.tp > 1:
        # AutoTP splits the layers at any stage: Accelerate's get_state_dict gathers the shards for the final model
        # only with this on, and HF Trainer otherwise saves no weights
        plan.note("stage3_gather_16bit_weights_on_model_save", True, "AutoTP: the final model gathers the TP shards")
    if plan.stage in (1, 2):
        _rule_or_recipe(plan, "contiguous_gradients", "zero.contiguous_gradients", True, "always: less fragmentation")
        _rule_or_recipe(
            plan,
            "round_robin_gradients",
            "zero.round_robin_gradients",
            offload,
            "on only with optimizer offload at stage 1/2" if offload else "no offload",
        )
        if offload:
            _pin_memory(plan, "offload_optimizer")
    elif plan.stage == 3:
        _rule_or_recipe(plan, "contiguous_gradients", "zero.contiguous_gradients", True, "always: less fragmentation")
        _rule_or_recipe(plan, "sub_group_size", "zero.sub_group_size", SUB_GROUP_SIZE, "1e9")
        plan.note("stage3_gather_16bit_weights_on_model_save", True, "the final model must load with from_pretrained")
        if offload:
            _pin_memory(plan, "offload_optimizer")
        if plan.offload_params != "none":
            _pin_memory(plan, "offload_param")
    plan.note(
        "zero3_init_flag",
        plan.stage == 3,
        "stage 3: partition weights while loading" if plan.stage == 3 else "stage < 3",
    )


# What steps the optimizer, as ``optimizer.impl`` records it (ftkit explain; docs/design.md, Rendering rules)
IMPL_TORCH_FUSED = "torch-fused"  # torch.optim.AdamW(fused=True) where the weights are
IMPL_CPU_ADAM = "cpu-adam"  # deepspeed.ops.adam.DeepSpeedCPUAdam (optimizer offload)
IMPL_TORCH_CPU = "torch-cpu"  # torch.optim.AdamW(fused=True) on the offloaded CPU states


def decide_optimizer(plan: Plan) -> None:
    """The optimizer block of ds_config.json: always AdamW with TrainingArguments' values; which implementation
    DeepSpeed builds from it is the choice (docs/design.md, Rendering rules).

    Nothing is compiled unless the plan needs it: without optimizer offload DeepSpeed builds torch's fused AdamW
    (``torch_adam``: DeepSpeed's own FusedAdam is a just-in-time nvcc build on every rank, which failed on a GPU
    machine without the CUDA toolkit and with an arch list DeepSpeed cannot parse). With offload the step runs on
    the CPU: DeepSpeed's CPU Adam (a build, checked on every host before the ranks start) or torch's AdamW
    (``zero.cpu_adam``)."""
    r = plan.recipe
    plan.note("optimizer", "AdamW", "params equal TrainingArguments (learning rate, betas, epsilon, weight decay)")
    if plan.offload_optimizer == "none":
        plan.note(
            "optimizer.torch_adam",
            True,
            "torch's AdamW, nothing to compile (DeepSpeed's FusedAdam is a just-in-time nvcc build on every rank)",
        )
        plan.note("optimizer.fused", True, "torch's fused AdamW kernel (HF's adamw_torch_fused)")
        plan.note(
            "optimizer.impl", IMPL_TORCH_FUSED, "torch.optim.AdamW(fused=True) where the weights are (no offload)"
        )
        return
    cpu_adam = r.zero.cpu_adam
    if cpu_adam is True or (cpu_adam == "auto" and plan.cpu_adam_ok):
        why = (
            "zero.cpu_adam true: DeepSpeedCPUAdam (every host must have it prebuilt or be able to build it)"
            if cpu_adam is True
            else "zero.cpu_adam auto: DeepSpeedCPUAdam, prebuilt or buildable on every host (checked by the launch)"
        )
        plan.note("optimizer.impl", IMPL_CPU_ADAM, why)
        return
    why = (
        "zero.cpu_adam false: torch's AdamW steps on the CPU, nothing to compile"
        if cpu_adam is False
        else "zero.cpu_adam auto: a host cannot build DeepSpeed's CPU Adam (the launch's preflight), so torch's "
        "AdamW steps on the CPU"
        if plan.cpu_adam_ok is False
        else "zero.cpu_adam auto: torch's AdamW on the CPU (nothing to compile); ftkit launch uses DeepSpeedCPUAdam "
        "instead where every host has it prebuilt or can build it"
    )
    plan.note("optimizer.torch_adam", True, why)
    plan.note("optimizer.fused", True, "torch's fused AdamW kernel for the offloaded CPU states")
    plan.note("optimizer.impl", IMPL_TORCH_CPU, why)


def compiled_ops(plan: Plan) -> list[str]:
    """The DeepSpeed ops (``OpBuilder.name``) the ranks must load for this plan: each is prebuilt or a just-in-time
    build on every host (``ftkit.run.ops`` checks and warms them up before any rank starts). FSDP2 needs none."""
    if plan.recipe.train.backend != "deepspeed":
        return []
    ops = []
    if "optimizer.impl" in plan.knobs and plan.knobs["optimizer.impl"].value == IMPL_CPU_ADAM:
        ops.append("cpu_adam")
    if "nvme" in (plan.offload_optimizer, plan.offload_params):
        ops.append("async_io")
    return ops


def ops_reason(plan: Plan) -> str:
    """What makes :func:`compiled_ops` need its ops, for the preflight's lines."""
    parts = []
    if "optimizer.impl" in plan.knobs and plan.knobs["optimizer.impl"].value == IMPL_CPU_ADAM:
        parts.append(f"zero.cpu_adam {str(plan.recipe.zero.cpu_adam).lower()}")
    if "nvme" in (plan.offload_optimizer, plan.offload_params):
        parts.append("nvme offload")
    return ", ".join(parts)


def _pin_memory(plan: Plan, what: str) -> None:
    if plan.recipe.zero.pin_memory != "auto":
        plan.note(f"{what}.pin_memory", plan.recipe.zero.pin_memory, "zero.pin_memory")
    elif plan.recipe.cluster.accelerator == "cpu":
        plan.note(f"{what}.pin_memory", False, "cpu accelerator: there is no device memory to pin for")
    elif plan.memory is not None and plan.memory.host_tight:
        plan.note(f"{what}.pin_memory", False, "host RAM is tight: pinned buffers cannot be paged out")
    else:
        plan.note(f"{what}.pin_memory", True, "faster host-device copies; host RAM allows it")


def decide_scheduler_knobs(plan: Plan) -> None:
    """DeepSpeed's own schedule (``train.lr_scheduler`` WarmupLR ... LRRangeTest), every parameter with where it
    comes from: ds_config.json's ``scheduler`` block, which HF Trainer hands to DeepSpeed instead of building its own
    schedule (transformers ``deepspeed_optim_sched``). The numbers are the ones HF would fill into ``"auto"``
    (``trainer_config_process``/``finalize``): the peak is learning_rate, the warm-up max(1, warmup_steps) (DeepSpeed
    >= 0.19.6 refuses 0), the length the run's optimizer steps. With train.epochs the step count is known only once
    the data is loaded: total_num_steps stays ``"auto"``, the one value the rendered config leaves to HF."""
    r = plan.recipe
    schedule = r.train.lr_scheduler
    if schedule not in DEEPSPEED_SCHEDULES:
        return
    plan.note("scheduler", schedule, "train.lr_scheduler: DeepSpeed's own schedule, in ds_config.json")
    warmup = max(1, r.train.warmup_steps)
    if schedule in ("WarmupLR", "WarmupDecayLR"):
        plan.note("scheduler.warmup_max_lr", r.train.learning_rate, "train.learning_rate (HF: learning_rate)")
    if schedule in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        why = f"max(1, train.warmup_steps {r.train.warmup_steps}), as HF fills it"
        plan.note("scheduler.warmup_num_steps", warmup, why)
    if schedule in ("WarmupDecayLR", "WarmupCosineLR"):
        if r.train.max_steps is not None:
            plan.note("scheduler.total_num_steps", r.train.max_steps, "train.max_steps (HF: the run's optimizer steps)")
        else:
            plan.note(
                "scheduler.total_num_steps",
                "auto",
                f"train.epochs {r.train.epochs}: HF fills the run's optimizer steps once the data is loaded",
            )
    values = plan.recipe.values
    for name in SCHEDULER_PARAMS[schedule]:
        value = values[f"scheduler.{name}"]
        if value is None:  # OneCycle's optional second half: DeepSpeed's own default applies
            continue
        plan.note(f"scheduler.{name}", value, f"scheduler.{name}")
