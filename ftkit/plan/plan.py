"""From the inputs of a recipe to a Plan: every number the configs need, with its reason.

The plan is the single place where derived values are computed: world size, the batch triple, the ZeRO stage and
offload (resolving ``auto`` through :mod:`ftkit.plan.candidates`), bucket sizes from the model's hidden size.
Renderers and the training entry only read it, so the DeepSpeed JSON, the Accelerate YAML and the TrainingArguments
agree. Every knob the configs carry is decided here (the rules in :mod:`ftkit.plan.knobs`) with where its value
came from; ``ftkit explain`` prints that without rendering anything.

:func:`plan_from` is pure: everything it reads is in its :class:`~ftkit.plan.types.PlanInputs`, gathered once at the
edge (:func:`ftkit.plan.inputs.gather`). :func:`build_plan` is the two together, with the step-time calibration from
the run directory's own earlier attempts (:func:`calibration_points`). ``train.backend: auto`` picks its candidate
first and builds the plan once, for that backend.
"""

from __future__ import annotations

import dataclasses

from ftkit.cluster.hosts import LOCAL_HOSTS
from ftkit.errors import FtkitError, Problem, RecipeError
from ftkit.plan.calibrate import measured_step, run_recipe
from ftkit.plan.candidates import plan_memory, predict_plan
from ftkit.plan.comm import ZeroPP
from ftkit.plan.fsdp import resolve_fsdp
from ftkit.plan.inputs import gather, resolve_cluster
from ftkit.plan.knobs import decide_config_knobs, decide_zero_knobs
from ftkit.plan.local_tier import plan_local_tier
from ftkit.plan.memory import PRECISION_BYTES, Candidate, Fsdp2
from ftkit.plan.parallel import layout_facts, note_layout, resolve_layout
from ftkit.plan.speed import Calibration, CalPoint, fit
from ftkit.plan.types import Knob, KnobValue, MemoryReport, Plan, PlanInputs
from ftkit.recipe.load import CLI, DEFAULT, Recipe
from ftkit.recipe.rules import layout_problems

__all__ = ["Knob", "KnobValue", "MemoryReport", "Plan", "PlanInputs", "build_plan", "plan_from", "resolve_hosts"]


def _src(recipe: Recipe, key: str) -> str:
    s = recipe.sources.get(key, DEFAULT)
    return "recipe default" if s == DEFAULT else ("command line" if s == CLI else s)


def resolve_hosts(recipe: Recipe, include: str | None = None, exclude: str | None = None) -> list[tuple[str, int]]:
    """The (host, slots) list in rank order: from the hostfile when given, else num_nodes x gpus_per_node."""
    return resolve_cluster(recipe, include, exclude)[0]


def build_plan(
    recipe: Recipe,
    *,
    include: str | None = None,
    exclude: str | None = None,
    hosts: list[tuple[str, int]] | None = None,
    devices: dict[str, tuple[int, ...]] | None = None,
    with_memory: bool = True,
    strict: bool = True,
    unknown_model_ok: bool = False,
    calibrate: bool = True,
    cpu_adam_ok: bool | None = None,
) -> Plan:
    """Gather the recipe's inputs (:func:`ftkit.plan.inputs.gather`, with the calibration kept beside the run, which
    ``ftkit plan --calibrate`` or ``--probe`` wrote) and build the plan (:func:`plan_from`).

    The run directory's own earlier attempts calibrate ``ftkit plan``'s numbers (:func:`ftkit.plan.load.plan_report`),
    not a launch's choices: a relaunch must keep the stage its checkpoints were saved with (another is refused).
    ``cpu_adam_ok`` (ftkit launch, after its preflight probed every host): whether DeepSpeed's CPU Adam loads
    everywhere, for ``zero.cpu_adam: auto`` (:attr:`PlanInputs.cpu_adam_ok`)."""
    inputs = gather(
        recipe,
        include=include,
        exclude=exclude,
        hosts=hosts,
        devices=devices,
        with_memory=with_memory,
        calibrate=calibrate,
    )
    if cpu_adam_ok is not None:
        inputs = dataclasses.replace(inputs, cpu_adam_ok=cpu_adam_ok)
    return plan_from(inputs, with_memory=with_memory, strict=strict, unknown_model_ok=unknown_model_ok)


def merged(cal: Calibration | None, points: list[CalPoint], gpu: str) -> Calibration:
    """``cal``'s points and ``points`` (a run's newer measurement replaces its older one), fitted again."""
    runs = {p.run for p in points}
    kept = [p for p in (cal.points if cal is not None else ()) if p.run not in runs]
    every = [*kept, *points]
    source = ", ".join(dict.fromkeys(p.run for p in every))
    return fit(gpu, every, source)


def calibration_points(run_dirs: list[str], gpu: str, skipped: dict[str, str] | None = None) -> list[CalPoint]:
    """One point per run directory that measured enough steps and ran on this GPU class: its measured seconds per
    step against this planner's uncalibrated parts for the configuration it ran (its ``ftkit/spec.json``). Why a
    directory gave none goes to ``skipped``."""
    out = []
    why: dict[str, str] = {} if skipped is None else skipped
    for d in run_dirs:
        measured = measured_step(d)
        if measured is None:
            why[d] = "too few logged steps to measure a step time (metrics.jsonl)"
            continue
        ran = run_recipe(d)
        if ran is None:
            why[d] = "not an ftkit run directory (no ftkit/spec.json)"
            continue
        recipe, hosts = ran
        try:
            inputs = gather(recipe, hosts=hosts, calibrate=False)
            if inputs.gpu != gpu or inputs.shape is None:
                why[d] = f"ran on {inputs.gpu}, another GPU class than this recipe's ({gpu}): it cannot calibrate it"
                continue
            plan = plan_from(inputs, strict=False)
            pred = predict_plan(plan)
        except (FtkitError, OSError, ValueError, TypeError, KeyError) as e:
            why[d] = f"its recorded recipe cannot be planned again ({(str(e).splitlines() or [type(e).__name__])[0]})"
            continue
        raw = pred.uncalibrated
        if raw is None:
            continue
        other = pred.exposed_comm_s + pred.host_s
        out.append(CalPoint(str(d), pred.candidate.label, measured[0], raw.gpu_s, raw.host_s, other, measured[1]))
    return out


def plan_from(
    inputs: PlanInputs,
    *,
    with_memory: bool = True,
    strict: bool = True,
    unknown_model_ok: bool = False,
) -> Plan:
    """Compute every derived value of the run from ``inputs`` (no I/O); raises RecipeError naming the numbers when
    they do not fit.

    ``strict=False`` (``ftkit plan``) keeps going when ``auto`` finds nothing that fits: the plan then carries
    the slowest candidate so the table and the suggestions can still be printed. ``unknown_model_ok`` (a user
    command, which loads its own model): a config.json that cannot be read is no error; the plan uses DeepSpeed's
    default bucket sizes, estimates no memory, and says so in ``Plan.unknown`` (``zero.stage: auto`` still needs it).
    """
    recipe = inputs.recipe
    problems: list[Problem] = []
    hosts = list(inputs.hosts)
    devices = dict(inputs.devices)
    world = sum(n for _, n in hosts)

    def problem(key: str, message: str) -> None:
        problems.append(recipe.problem(key, message))

    micro = recipe.train.micro_batch_size
    gbs = recipe.train.global_batch_size
    # parallel.tp / sp: auto starts from data parallelism alone and is resolved below (ftkit.plan.parallel)
    tp = recipe.parallel.tp if isinstance(recipe.parallel.tp, int) else 1
    sp = recipe.parallel.sp if isinstance(recipe.parallel.sp, int) else 1
    dp = world // (tp * sp) if world % (tp * sp) == 0 else world
    per_step = micro * dp
    if gbs % per_step != 0 and tp * sp == 1:
        problem(
            "train.global_batch_size",
            f"{gbs} is not divisible by micro_batch_size {micro} x world size {world} = {per_step}; "
            f"use a multiple of {per_step} (e.g. {max(per_step, gbs - gbs % per_step)}) or change micro_batch_size",
        )
    elif gbs % per_step != 0:
        problem(
            "train.global_batch_size",
            f"{gbs} is not divisible by micro_batch_size {micro} x data-parallel degree {dp} (world size {world} / "
            f"{_layout(tp, sp)}) = {per_step}; use a multiple of {per_step} (e.g. "
            f"{max(per_step, gbs - gbs % per_step)}) or change micro_batch_size",
        )
    engine = recipe.cluster.engine
    if engine in ("torchrun", "accelerate") and len({n for _, n in hosts}) > 1:
        problem(
            "cluster.engine",
            f"{engine} needs the same number of processes on every host; the hostfile has "
            f"{', '.join(f'{h}={n}' for h, n in hosts)} (use engine: deepspeed)",
        )
    min_nodes = recipe.cluster.min_nodes
    if min_nodes is not None and min_nodes > len(hosts):
        problem("cluster.min_nodes", f"{min_nodes} is more than the {len(hosts)} host(s) in the cluster")

    master = recipe.cluster.master_addr
    if master is None:
        first = hosts[0][0]
        if len(hosts) == 1 and first in LOCAL_HOSTS:
            master, master_why = "127.0.0.1", "single local node"
        elif engine == "slurm":
            master, master_why = first, "first node of the Slurm allocation"
        elif recipe.cluster.hostfile is None:
            problem(
                "cluster.master_addr",
                f"required when num_nodes is {len(hosts)} without a hostfile: the address of the first node",
            )
            master, master_why = "", ""
        else:
            master, master_why = first, "first host of the hostfile"
    else:
        master_why = _src(recipe, "cluster.master_addr")

    cfg, h = inputs.model_config, inputs.hidden_size
    unknown_why = inputs.model_unknown
    if inputs.model_problems:  # ModelConfigError: re-anchor it at the recipe's model.path line
        key = "model.config" if recipe.model.config else "model.path"
        if not unknown_model_ok:
            for p in inputs.model_problems:
                problem(key, p.message if p.file else str(p))
        elif recipe.zero.stage == "auto" or recipe.zero.offload_optimizer == "auto":
            problem("zero.stage", f"auto needs the model's config ({unknown_why}): set zero.stage and offload")
        cfg, h = {}, 0
    if tp * sp > 1:
        for key, message in layout_problems(tp, sp, **layout_facts(recipe, hosts, cfg)):
            problem(key, message)
    if problems:
        raise RecipeError(problems)

    plan = Plan(
        recipe=recipe,
        hosts=hosts,
        master_addr=master,
        master_port=inputs.master_port,
        micro_batch_size=micro,
        grad_accum=gbs // per_step,
        global_batch_size=gbs,
        stage=0,
        offload_optimizer="none",
        offload_params="none",
        hidden_size=h,
        model_config=cfg,
        model_config_file=inputs.model_config_file,
        model_config_label=inputs.model_config_label,
        devices=devices,
        inputs=inputs,
        tp=tp,
        sp=sp,
    )
    label = inputs.model_config_label or f"{recipe['model.path']}/config.json"
    plan.note(
        "world_size",
        world,
        f"{len(hosts)} node(s): "
        + ", ".join(f"{n} on {h_}" + (f" (devices {_ints(devices[h_])})" if h_ in devices else "") for h_, n in hosts),
    )
    plan.note("master_addr", master, master_why)
    plan.note(
        "train_micro_batch_size_per_gpu", micro, f"train.micro_batch_size ({_src(recipe, 'train.micro_batch_size')})"
    )
    if tp * sp == 1:
        plan.note(
            "gradient_accumulation_steps", plan.grad_accum, f"global_batch_size {gbs} / (micro {micro} x world {world})"
        )
    else:
        note_layout(plan, _src(recipe, "parallel.tp"), _src(recipe, "parallel.sp"))
    plan.note("train_batch_size", gbs, f"train.global_batch_size ({_src(recipe, 'train.global_batch_size')})")
    plan.note("hidden_size", h, label)

    if not cfg and unknown_model_ok:
        plan.unknown.append(
            f"model: {unknown_why}: memory and step time not estimated; bucket sizes are DeepSpeed's defaults"
        )
        with_memory = False
    if "auto" in (recipe.parallel.tp, recipe.parallel.sp):
        resolve_layout(plan, with_memory=with_memory, strict=strict)
    if recipe.train.backend == "auto":
        _resolve_backend(plan, with_memory, strict)
    if plan.recipe.train.backend == "fsdp2":
        resolve_fsdp(plan, _src)
        _resolve_local_tier(plan)
        _note_backend(plan)
        return plan
    _resolve_zero(plan, with_memory, strict)
    if plan.unknown:  # no hidden size: DeepSpeed's own defaults instead of h-derived sizes
        for knob, key, value in (
            ("reduce_bucket_size", "zero.reduce_bucket_size", int(5e8)),
            ("stage3_prefetch_bucket_size", "zero.prefetch_bucket_size", int(5e7)),
            ("stage3_param_persistence_threshold", "zero.param_persistence_threshold", int(1e5)),
        ):
            if recipe[key] == "auto":
                plan.note(knob, value, "DeepSpeed's default: the model's hidden size is unknown")
    decide_config_knobs(plan)
    _resolve_local_tier(plan)
    _note_backend(plan)
    return plan


def _note_backend(plan: Plan) -> None:
    """``train.backend: auto``: the backend and the choice's knobs, with the choice's reason."""
    report = plan.backend_report
    if report is None:
        return
    why = f"auto: {report.choice_reason}"
    plan.note("backend", plan.recipe.train.backend, why)
    if plan.recipe.train.backend == "fsdp2":
        plan.note("fsdp_reshard_after_forward", plan.stage == 3, why)
        plan.note("fsdp_offload_params", plan.offload_params != "none", why)
    else:
        plan.note("zero_optimization.stage", plan.stage, why)


def _resolve_backend(plan: Plan, with_memory: bool, strict: bool) -> None:
    """``train.backend: auto``: the fastest candidate that fits across ZeRO and FSDP2 (one memory and step-time
    model, :func:`ftkit.plan.candidates.plan_memory`) picks the backend, first; the plan then goes on with the
    recipe made concrete (that backend, that candidate's settings), so everything downstream (configs, spec, ranks)
    sees ``deepspeed`` or ``fsdp2``. A tie goes to DeepSpeed (listed first)."""
    r = plan.recipe
    if not with_memory or plan.unknown:
        raise RecipeError(
            r.problem(
                "train.backend",
                "auto needs the model's config to compare the backends: set train.backend deepspeed or fsdp2",
            )
        )
    report = plan_memory(plan)
    if report.choice.chosen is None and strict:
        raise RecipeError(
            r.problem(
                "train.backend", f"auto: nothing fits on either backend ({report.choice_reason}); run `ftkit plan`"
            )
        )
    # ftkit plan (not strict) with nothing that fits: the ZeRO side's own fallback, so the table and the suggestions
    # still print (exit 10)
    cand = report.choice.chosen.candidate if report.choice.chosen is not None else None
    values = dict(r.values)
    if isinstance(cand, Fsdp2):
        values.update(
            {
                "train.backend": "fsdp2",
                "fsdp.reshard_after_forward": cand.stage == 3,
                "fsdp.offload_params": cand.offload_params != "none",
            }
        )
    else:
        values["train.backend"] = "deepspeed"
    plan.recipe = dataclasses.replace(r, values=values)
    plan.backend_report = report


def _resolve_local_tier(plan: Plan) -> None:
    """checkpoint.local_dir / local_steps, with the memory the tier needs per node (ftkit.plan.local_tier)."""
    r = plan.recipe
    rep = plan.memory
    total = rep.shape.total_params if rep is not None else None
    trainable = (rep.workload.lora_params or total) if rep is not None else None
    selected = rep.selected if rep is not None else None
    step_s = None
    if rep is not None and selected is not None and selected.candidate.label in rep.predictions:
        step_s = rep.predictions[selected.candidate.label].step_time_s
    save_s = plan.inputs.measured_save_s if plan.inputs is not None else None
    measured_step = plan.inputs.measured_step_s if plan.inputs is not None else None
    tier, why = plan_local_tier(
        r,
        num_nodes=plan.num_nodes,
        per_node=plan.procs_per_node,
        world_size=plan.world_size,
        stage=plan.stage,
        total_params=total,
        trainable_params=trainable,
        weight_bytes=PRECISION_BYTES[r.train.precision],
        host_memory_gb=r.cluster.host_memory_gb,
        host_used_gb=selected.host_ram_gb_per_node if selected is not None else 0.0,
        step_time_s=step_s,
        measured_save_s=save_s,
        measured_step_s=measured_step,
        run_dir=plan.inputs.run_dir if plan.inputs is not None and plan.inputs.run_dir else None,
    )
    plan.local_tier, plan.local_tier_off = tier, why
    if tier is not None:
        plan.note("local_tier", tier.dir, tier.why.split("; ", 1)[0])
        plan.note("local_steps", tier.steps, tier.why.split("; ", 1)[-1])


def note_zeropp(plan: Plan, chosen: Candidate, why: str) -> None:
    """ZeRO++'s knobs when ``auto`` chose a ZeRO++ candidate (by predicted speed across nodes, ftkit.plan.comm)."""

    if isinstance(chosen, ZeroPP):
        plan.note("zero_hpz_partition_size", chosen.hpz, f"hpZ over one node's {chosen.hpz} ranks: {why}")
        plan.note("zero_quantized_weights", chosen.qwz, f"qwZ: {why}")
        plan.note("zero_quantized_gradients", chosen.qgz, f"qgZ: {why}")


def _layout(tp: int, sp: int) -> str:
    return " x ".join([f"tp {tp}"] * (tp > 1) + [f"sp {sp}"] * (sp > 1))


def _ints(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def _resolve_zero(plan: Plan, with_memory: bool, strict: bool = True) -> None:

    r = plan.recipe
    stage, opt = r.zero.stage, r.zero.offload_optimizer
    needs_memory = (
        stage == "auto" or opt == "auto" or r.zero.overlap_comm == "auto" or r.zero.allgather_bucket_size == "auto"
    )
    report = None
    if needs_memory and with_memory:
        report = plan_memory(plan)
        plan.memory = report
    if stage == "auto" or opt == "auto":
        if report is None:  # pragma: no cover - with_memory=False is only used where stage is concrete
            raise RecipeError(r.problem("zero.stage", "auto needs the memory planner"))
        chosen = report.choice_for(stage, opt, strict=strict)
        stage_v, opt_v = chosen.stage, chosen.offload_optimizer
        why = f"auto: {report.choice_reason}"
        plan.stage = plan.note("zero_optimization.stage", stage_v, why if stage == "auto" else _src(r, "zero.stage"))
        plan.offload_optimizer = plan.note(
            "offload_optimizer", opt_v, why if opt == "auto" else _src(r, "zero.offload_optimizer")
        )
        par_auto = stage == "auto" and "zero.offload_params" not in r.explicit
        plan.offload_params = plan.note(
            "offload_param", chosen.offload_params, why if par_auto else _src(r, "zero.offload_params")
        )
        note_zeropp(plan, chosen, why)
    else:
        plan.stage = plan.note("zero_optimization.stage", int(stage), _src(r, "zero.stage"))  # not auto here
        plan.offload_optimizer = plan.note("offload_optimizer", opt, _src(r, "zero.offload_optimizer"))
        plan.offload_params = plan.note("offload_param", r.zero.offload_params, _src(r, "zero.offload_params"))
    # No copy of the stage/offload rules here: the recipe loader reports a user's mistake (ftkit.recipe.load), a
    # Candidate refuses an impossible pairing (ftkit.plan.memory), and auto only ever chooses among valid candidates.
    Candidate(plan.stage, plan.offload_optimizer, plan.offload_params)

    decide_zero_knobs(plan, _src)
