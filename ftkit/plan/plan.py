"""From a validated recipe (plus cluster and model config) to a Plan: every number the configs need, with its reason.

The plan is the single place where derived values are computed: world size, the batch triple, the ZeRO stage and
offload (resolving ``auto`` through :mod:`ftkit.plan.memory`), bucket sizes from the model's hidden size. Renderers and
the training entry only read it, so the DeepSpeed JSON, the Accelerate YAML and the TrainingArguments agree.
Every knob the configs carry is decided here (the rules in :mod:`ftkit.plan.knobs`) with where its value came from;
``ftkit explain`` prints that without rendering anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, TypeVar

from ftkit.cluster.hostfile import apply_filters, parse_hostfile
from ftkit.cluster.hosts import LOCAL_HOSTS
from ftkit.cluster.slurm import allocation_hosts, in_allocation, job_port
from ftkit.errors import Problem, RecipeError, UserError
from ftkit.model.config import config_source
from ftkit.model.shape import hidden_size, load_config_file, load_model_config
from ftkit.plan.candidates import plan_memory
from ftkit.plan.comm import ZeroPP
from ftkit.plan.fsdp import resolve_fsdp
from ftkit.plan.knobs import decide_config_knobs, decide_zero_knobs
from ftkit.plan.memory import PRECISION_BYTES, Candidate, Fsdp2
from ftkit.plan.tiers import LocalTier, measured_costs, plan_local_tier
from ftkit.recipe.load import CLI, DEFAULT, Recipe
from ftkit.recipe.schema import Value
from ftkit.rundir.records import JSONObject

if TYPE_CHECKING:  # pragma: no cover
    from ftkit.plan.candidates import MemoryReport


KnobValue: TypeAlias = Value  # one value of ds_config.json or accelerate.yaml (a recipe value, or a rule's)
_V = TypeVar("_V", bound=KnobValue)


@dataclass(frozen=True)
class Knob:
    value: KnobValue
    why: str  # the rule or source that produced the value


@dataclass
class Plan:
    recipe: Recipe
    hosts: list[tuple[str, int]]  # (host, processes) in rank order
    master_addr: str
    master_port: int
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    stage: int
    offload_optimizer: str
    offload_params: str
    hidden_size: int
    model_config: JSONObject
    knobs: dict[str, Knob] = field(default_factory=dict)
    memory: MemoryReport | None = None  # the memory and step-time plan (ftkit.plan.candidates), when computed
    # host -> the device (slot) indices an --include/--exclude selection kept (empty without a filter): the command
    # builder hands them to the engine (deepspeed --include, else CUDA_VISIBLE_DEVICES on the node)
    devices: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # the config.json read for model_config (a model directory's, the hub cache's, or model.config) and its label
    model_config_file: str = ""
    model_config_label: str = ""
    # what the plan could not estimate (a user command's model whose config.json cannot be read): one line each
    unknown: list[str] = field(default_factory=list)
    local_tier: LocalTier | None = None  # the node-local checkpoint tier (ftkit.plan.tiers), None: off
    local_tier_off: str = ""  # why it is off
    # train.backend auto: the memory and step-time plan across both backends that chose this plan's backend
    backend_report: MemoryReport | None = None
    # whether every host of the launch can load DeepSpeed's CPU Adam (prebuilt, or a C++ compiler, ninja and, on a
    # CUDA host, nvcc to build it), as ftkit launch's preflight found (ftkit.run.ops); None: not checked (render,
    # plan): zero.cpu_adam auto then renders torch's AdamW, which needs nothing compiled
    cpu_adam_ok: bool | None = None

    @property
    def world_size(self) -> int:
        return sum(n for _, n in self.hosts)

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def procs_per_node(self) -> int:
        return self.hosts[0][1]

    @property
    def uniform(self) -> bool:
        return len({n for _, n in self.hosts}) == 1

    @property
    def is_local(self) -> bool:
        return self.num_nodes == 1 and self.hosts[0][0] in LOCAL_HOSTS

    @property
    def sharding_why(self) -> str:
        """Why the run shards as it does: the ZeRO stage's reason, or FSDP2's resharding choice."""
        knob = "fsdp_reshard_after_forward" if self.recipe.train.backend == "fsdp2" else "zero_optimization.stage"
        return self.knobs[knob].why

    def note(self, knob: str, value: _V, why: str) -> _V:
        self.knobs[knob] = Knob(value, why)
        return value


def _src(recipe: Recipe, key: str) -> str:
    s = recipe.sources.get(key, DEFAULT)
    return "recipe default" if s == DEFAULT else ("command line" if s == CLI else s)


def resolve_hosts(recipe: Recipe, include: str | None = None, exclude: str | None = None) -> list[tuple[str, int]]:
    """The (host, slots) list in rank order: from the hostfile when given, else num_nodes x gpus_per_node."""
    return resolve_cluster(recipe, include, exclude)[0]


def resolve_cluster(
    recipe: Recipe, include: str | None = None, exclude: str | None = None
) -> tuple[list[tuple[str, int]], dict[str, tuple[int, ...]]]:
    """The (host, slots) list in rank order, and the device indices a slot selection kept on each host.

    ``--include 'w0:1,3'`` on ``w0 slots=4`` gives ``[("w0", 2)]`` and ``{"w0": (1, 3)}``: two ranks, on devices 1
    and 3. With a filter every kept host is in the dict (as DeepSpeed, which sets each node's visible devices to
    its selection); without one the dict is empty and the ranks use devices ``0..n-1`` (of what is visible).
    """
    hostfile = recipe.cluster.hostfile
    if recipe.cluster.engine == "slurm":  # the allocation's nodes (ftkit launch refuses outside one)
        import os

        if include or exclude:
            raise RecipeError(Problem("--include/--exclude do not apply to engine slurm (use sbatch -w/-x)", file=CLI))
        if in_allocation(os.environ):
            return allocation_hosts(os.environ, recipe.cluster.gpus_per_node), {}
        return [(f"node{i}", recipe.cluster.gpus_per_node) for i in range(recipe.cluster.num_nodes)], {}
    if hostfile is None:
        if include or exclude:
            raise RecipeError(Problem("--include/--exclude need a hostfile (cluster.hostfile or --hostfile)", file=CLI))
        n = recipe.cluster.num_nodes
        if n == 1:
            return [("localhost", recipe.cluster.gpus_per_node)], {}
        return [(f"node{i}", recipe.cluster.gpus_per_node) for i in range(n)], {}

    hf = parse_hostfile(hostfile)
    if include or exclude:
        hf = apply_filters(hf, include=include, exclude=exclude)
    # This machine by any of its names (127.0.0.1, its hostname, its FQDN) is started locally, no ssh.
    local = hf.num_nodes == 1 and hf.is_local_only
    hosts = [("localhost" if local else h.name, h.slots) for h in hf.hosts]
    devices = {name: h.slot_indices for (name, _), h in zip(hosts, hf.hosts, strict=True)} if include or exclude else {}
    return hosts, devices


def _master_port(recipe: Recipe) -> int:
    """The recipe's port; under Slurm with the default port, one of the job's own (two jobs may share a node)."""
    import os

    port = recipe.cluster.master_port
    if recipe.cluster.engine == "slurm" and recipe.sources.get("cluster.master_port", DEFAULT) == DEFAULT:
        return job_port(os.environ, port)
    return port


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
    cpu_adam_ok: bool | None = None,
) -> Plan:
    """Compute every derived value of the run; raises RecipeError naming the numbers when they do not fit.

    ``cpu_adam_ok`` (ftkit launch, after its preflight probed every host): whether DeepSpeed's CPU Adam loads
    everywhere, for ``zero.cpu_adam: auto`` (:attr:`Plan.cpu_adam_ok`).

    ``strict=False`` (``ftkit plan``) keeps going when ``auto`` finds nothing that fits: the plan then carries
    the slowest candidate so the table and the suggestions can still be printed. ``unknown_model_ok`` (a user
    command, which loads its own model): a config.json that cannot be read is no error; the plan uses DeepSpeed's
    default bucket sizes, estimates no memory, and says so in ``Plan.unknown`` (``zero.stage: auto`` still needs it).
    """

    problems: list[Problem] = []
    if hosts is None:
        hosts, devices = resolve_cluster(recipe, include, exclude)
    devices = {h: d for h, d in (devices or {}).items() if h in {name for name, _ in hosts}}
    world = sum(n for _, n in hosts)

    def problem(key: str, message: str) -> None:
        problems.append(recipe.problem(key, message))

    micro = recipe.train.micro_batch_size
    gbs = recipe.train.global_batch_size
    per_step = micro * world
    if gbs % per_step != 0:
        problem(
            "train.global_batch_size",
            f"{gbs} is not divisible by micro_batch_size {micro} x world size {world} = {per_step}; "
            f"use a multiple of {per_step} (e.g. {max(per_step, gbs - gbs % per_step)}) or change micro_batch_size",
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

    source, unknown_why = None, ""
    try:
        source = config_source(recipe.model, base=recipe.base_dir)
        cfg = (
            load_config_file(source.file)
            if source.hub_id or recipe.model.config
            else load_model_config(recipe.model.path)
        )
        h = hidden_size(cfg)
    except UserError as e:  # ModelConfigError: re-anchor it at the recipe's model.path line
        key = "model.config" if recipe.model.config else "model.path"
        unknown_why = "; ".join(p.message for p in e.problems) or str(e)
        if not unknown_model_ok:
            for p in e.problems:
                problem(key, p.message if p.file else str(p))
        elif recipe.zero.stage == "auto" or recipe.zero.offload_optimizer == "auto":
            problem("zero.stage", f"auto needs the model's config ({unknown_why}): set zero.stage and offload")
        cfg, h = {}, 0
    if problems:
        raise RecipeError(problems)

    plan = Plan(
        recipe=recipe,
        hosts=hosts,
        master_addr=master,
        master_port=_master_port(recipe),
        micro_batch_size=micro,
        grad_accum=gbs // per_step,
        global_batch_size=gbs,
        stage=0,
        offload_optimizer="none",
        offload_params="none",
        hidden_size=h,
        model_config=cfg,
        model_config_file=source.file if source else "",
        model_config_label=source.label if source else "",
        devices=devices,
        cpu_adam_ok=cpu_adam_ok,
    )
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
    plan.note(
        "gradient_accumulation_steps", plan.grad_accum, f"global_batch_size {gbs} / (micro {micro} x world {world})"
    )
    plan.note("train_batch_size", gbs, f"train.global_batch_size ({_src(recipe, 'train.global_batch_size')})")
    plan.note("hidden_size", h, source.label if source else f"{recipe['model.path']}/config.json")

    if not cfg and unknown_model_ok:
        plan.unknown.append(
            f"model: {unknown_why}: memory and step time not estimated; bucket sizes are DeepSpeed's defaults"
        )
        with_memory = False
    if recipe.train.backend == "auto":
        return _resolve_backend(plan, with_memory, strict, unknown_model_ok)
    if recipe.train.backend == "fsdp2":
        resolve_fsdp(plan, _src)
        _resolve_local_tier(plan)
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
    return plan


def _resolve_backend(plan: Plan, with_memory: bool, strict: bool, unknown_model_ok: bool) -> Plan:
    """``train.backend: auto``: the fastest candidate that fits across ZeRO and FSDP2 (one memory and step-time
    model, :func:`ftkit.plan.candidates.plan_memory`) picks the backend; the plan is then built for that backend
    with that candidate's settings, so everything downstream (configs, spec, ranks) sees a concrete backend. A tie
    goes to DeepSpeed (listed first)."""
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
    concrete = dataclasses.replace(r, values=values)
    out = build_plan(
        concrete,
        hosts=plan.hosts,
        devices=plan.devices,
        with_memory=with_memory,
        strict=strict,
        unknown_model_ok=unknown_model_ok,
        cpu_adam_ok=plan.cpu_adam_ok,
    )
    why = f"auto: {report.choice_reason}"
    out.note("backend", values["train.backend"], why)
    if isinstance(cand, Fsdp2):
        out.note("fsdp_reshard_after_forward", cand.stage == 3, why)
        out.note("fsdp_offload_params", cand.offload_params != "none", why)
    else:
        out.note("zero_optimization.stage", out.stage, why)
    out.backend_report = report
    return out


def _resolve_local_tier(plan: Plan) -> None:
    """checkpoint.local_dir / local_steps, with the memory the tier needs per node (ftkit.plan.tiers)."""
    r = plan.recipe
    rep = plan.memory
    total = rep.shape.total_params if rep is not None else None
    trainable = (rep.workload.lora_params or total) if rep is not None else None
    selected = rep.selected if rep is not None else None
    step_s = None
    if rep is not None and selected is not None and selected.candidate.label in rep.predictions:
        step_s = rep.predictions[selected.candidate.label].step_time_s
    save_s, measured_step = measured_costs(Path(r.train.output_dir))
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
