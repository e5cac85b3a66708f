"""Rules across recipe keys that the schema's per-field types cannot state: which ZeRO stage/offload combinations
DeepSpeed can run, and which keys belong to which sharding backend. The loader reports them to the user; the
planner's candidates obey them."""

from __future__ import annotations

from collections.abc import Collection, Mapping

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
