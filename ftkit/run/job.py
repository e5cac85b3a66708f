"""``ftkit launch`` as a library call: plan → own the run directory → preflight → decide the resume → write the
run's configs and spec → supervise → summary.

The order is the contract of docs/design.md, Run directory: nothing of the run directory (spec, configs,
checkpoints) is written before the run is owned (:mod:`ftkit.run.ownership`) and the resume decision is made: which
checkpoint, and whether what changed since it was saved may be applied (:mod:`ftkit.run.fingerprint`). A refused
launch leaves the directory as it found it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from ftkit.checkpoint.directory import select_resume
from ftkit.cluster.slurm import require_allocation, transport_for
from ftkit.command.engines import LaunchInputs, arch_note, build_launch, describe
from ftkit.command.user_command import UserCommand, builtin_only_keys, inject_dir, module_exists, parse_command
from ftkit.errors import ExitCode, FtkitError, NoSpace, RecipeError, UserError
from ftkit.model.config import checked_in_drift
from ftkit.plan.memory import zero_label
from ftkit.plan.plan import Plan, build_plan
from ftkit.recipe.load import Recipe, load_recipe
from ftkit.report.live import launch_refresher, plan_record
from ftkit.run.doctor import build_env, cheap_checks
from ftkit.run.fingerprint import compare, compute
from ftkit.run.ops import settle_optimizer, warm_up
from ftkit.run.ownership import Ownership, owner_state, stop_leftovers
from ftkit.run.prepare import prepare_run
from ftkit.run.status import format_summary, summarize
from ftkit.rundir.env import read_deepspeed_env
from ftkit.rundir.layout import RunDir
from ftkit.rundir.owner import read_owner
from ftkit.rundir.records import JSON, Fingerprint
from ftkit.supervise.choose import Choice, StepLimits, foreign_refusal, select, space_refusal
from ftkit.supervise.stopping import STOP_SIGNALS
from ftkit.supervise.supervisor import Supervisor, SupervisorConfig


def launch_inputs(
    plan: Plan, attempt: int = 0, resume: str | None = None, command: UserCommand | None = None, inject: bool = True
) -> LaunchInputs:
    r = plan.recipe

    return LaunchInputs(
        engine=r.cluster.engine,
        hosts=tuple(plan.hosts),
        master_addr=plan.master_addr,
        master_port=plan.master_port,
        run_dir=str(Path(r.train.output_dir).resolve()),
        attempt=attempt,
        resume=resume,
        accelerator=r.cluster.accelerator,
        python=sys.executable,
        name=r.name,
        ssh_config=r.cluster.ssh_config,
        devices=dict(plan.devices),
        command=command,
        inject=inject,
        inject_path=inject_dir() if command is not None and inject else None,
        workdir=os.getcwd() if command is not None else None,
        cluster_env=tuple(r.cluster.env or ()),
        deepspeed_env=read_deepspeed_env([Path.home(), os.getcwd()]),
    )


def plan_summary(plan: Plan) -> str:
    hosts = ", ".join(f"{h} ({n})" for h, n in plan.hosts)
    r = plan.recipe
    zero = zero_label(plan.stage, plan.offload_optimizer, plan.offload_params)
    steps = f"{r['train.max_steps']} steps" if r.train.max_steps else f"{r['train.epochs']} epochs"
    ranks = f"{plan.world_size} ranks"
    if plan.tp * plan.sp > 1:  # only the data-parallel ranks multiply the batch
        ranks = f"{plan.dp_size} data-parallel rank(s); layout tp {plan.tp} x sp {plan.sp} x dp {plan.dp_size}"
    return (
        f"plan: {r['cluster.engine']} on {plan.num_nodes} node(s): {hosts}; world size {plan.world_size}; "
        f"{zero}; batch {plan.global_batch_size} = micro {plan.micro_batch_size} x accum "
        f"{plan.grad_accum} x {ranks}; {steps}; {'LoRA' if r.has_peft else 'full fine-tuning'}, "
        f"{r['train.precision']}\nrun directory: {r['train.output_dir']}"
    )


@dataclass(frozen=True)
class LaunchRequest:
    recipe: str
    overrides: tuple[str, ...] = ()
    include: str | None = None
    exclude: str | None = None
    dry_run: bool = False
    takeover: bool = False
    allow_changes: tuple[str, ...] = ()
    command: tuple[str, ...] | None = None  # `-- CMD [ARGS]`: run this on every rank (else train.command, if set)
    inject: bool = True  # --no-inject: no import hook for the command


class Interrupted(FtkitError):
    """A signal before supervision began (during preflight): nothing was started, exit 128+N."""

    def __init__(self, signum: int):
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name} before anything was started")


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
    raise Interrupted(signum)


def ssh_args_of(plan: Plan) -> list[str]:
    cfg = plan.recipe.cluster.ssh_config
    return ["-F", cfg] if cfg else []


def require_launchable(recipe: Recipe) -> None:
    """What ``ftkit launch`` and ``ftkit submit`` cannot run yet, refused before anything starts: FSDP2 ranks under
    an engine other than Accelerate's (only ``accelerate launch`` turns accelerate.yaml into the ranks' FSDP plugin;
    torchrun and srun would need its environment spelled out)."""
    engine = recipe.cluster.engine
    if recipe.train.backend == "fsdp2" and engine != "accelerate":
        raise RecipeError(
            recipe.problem(
                "cluster.engine",
                f"{engine} under train.backend fsdp2: ftkit launches FSDP2 ranks with accelerate only; set "
                "cluster.engine accelerate (the default under fsdp2)",
            )
        )


def require_launchable_layout(plan: Plan, custom: bool) -> None:
    """The tensor/sequence-parallel layouts ftkit launch runs: TP through DeepSpeed AutoTP (ds_config.json's
    ``tensor_parallel``, which HF Trainer applies, the built-in entry's or a script's), SP through the built-in
    entry (ALST/Ulysses: it builds TrainingArguments' ``parallelism_config`` and batches with positions). The rest is
    refused before anything starts, never run as data parallelism under another name: FSDP2 x TP and SP in a
    script of the user's own are rendered for their own launchers."""
    if plan.tp > 1 and plan.recipe.train.backend == "fsdp2":
        raise RecipeError(
            plan.recipe.problem(
                "parallel.tp",
                f"tp {plan.tp} under train.backend fsdp2: ftkit launch runs tensor parallelism through DeepSpeed "
                "AutoTP only; set train.backend deepspeed, or use the rendered accelerate.yaml with your own launcher",
            )
        )
    if plan.sp > 1 and custom:
        raise RecipeError(
            plan.recipe.problem(
                "parallel.sp",
                f"sp {plan.sp} with a script of your own: ftkit launch runs sequence parallelism with its built-in "
                "entry; a script sets it up itself (TrainingArguments' parallelism_config, batches with "
                "position_ids), with the rendered accelerate.yaml and ds_config.json",
            )
        )


def launch(req: LaunchRequest, echo: Callable[[str], None] = print, warn: Callable[[str], None] | None = None) -> int:
    """Run the job; returns the exit code (docs/exit-codes.md). Raises FtkitError for what ends it before start.
    ``warn`` gets warnings (stderr on the command line)."""

    recipe = load_recipe(req.recipe, list(req.overrides))
    require_launchable(recipe)
    if recipe.cluster.engine == "slurm":  # hosts, ranks and teardown come from the allocation: none, none here
        require_allocation(os.environ)
    # A user command loads its own model: a config.json the plan cannot read limits the plan, not the launch.
    custom = req.command is not None or recipe.train.command is not None
    plan = build_plan(recipe, include=req.include, exclude=req.exclude, unknown_model_ok=custom)
    require_launchable_layout(plan, custom)

    # model.config (checked in) differs from the model's real config.json
    warning = checked_in_drift(plan.recipe.model, plan.recipe.base_dir)
    if warning:
        (warn or echo)(warning)
    command = _user_command(plan, req, echo, warn or echo)
    for line in plan.unknown:
        (warn or echo)(f"ftkit: warning: the plan could not estimate everything: {line}")
    echo(plan_summary(plan))
    note = arch_note(os.environ, recipe.cluster.env or ())
    if note:
        echo(f"ftkit: note: {note}")
    _check_inputs(plan, command)
    if req.dry_run:
        code = _dry_run_verdict(plan, req, echo)
        echo(dry_run(plan, command, req.inject))
        return code
    # Until the supervisor installs its own handlers, a signal ends the launch at once (subprocess.run kills a
    # running ssh probe when the exception passes through it): exit 128+N, nothing started.
    old = {s: signal.signal(s, _raise_interrupted) for s in STOP_SIGNALS}

    def replan(cpu_adam_ok: bool) -> Plan:  # the same plan, with what the preflight found on every host
        return build_plan(
            recipe, include=req.include, exclude=req.exclude, unknown_model_ok=custom, cpu_adam_ok=cpu_adam_ok
        )

    try:
        return _owned_launch(plan, req, echo, command, replan)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _check_inputs(plan: Plan, command: UserCommand | None) -> None:
    """What would end the launch right after it starts, checked before anything is owned or started (read-only)."""

    r = plan.recipe
    if command is None:  # the built-in entry reads them: a missing file would fail every rank after its start-up
        problems = []
        for key, path in (("data.train", r.data.train), ("data.eval", r.data.eval)):
            if path is None:
                continue
            data = Path(path)
            if not data.is_file():
                what = "is a directory, expected a file" if data.is_dir() else "file not found"
                problems.append(r.problem(key, f"{data}: {what}"))
        if problems:
            raise RecipeError(problems)
    refusal = foreign_refusal(RunDir(r.train.output_dir))
    if refusal is not None:
        raise UserError(refusal)


def _dry_run_verdict(plan: Plan, req: LaunchRequest, echo: Callable[[str], None]) -> int:
    """The exit code the launch would have, from the same checks it makes before starting anything (read-only):
    the run directory's owner, the resume choice and what changed since that checkpoint. Not the preflight
    (ssh to every host): `ftkit doctor` runs that."""

    r = plan.recipe
    rd = RunDir(r.train.output_dir)
    owner = read_owner(rd) if rd.meta.is_dir() else None
    if owner is not None and owner_state(owner, ssh_args_of(plan)) != "dead":
        echo(f"ftkit: error: a live job owns {rd.path} ({owner.describe()}): a launch now would be refused")
        return ExitCode.RUN_BUSY
    choice = select(
        rd,
        checksums=bool(r.resilience.verify_checksums),
        world_size=plan.world_size,
        stage=plan.stage,
        max_steps=r.train.max_steps,
        limits=step_limits(plan),
    )
    for v in choice.selection.rejected if choice.selection else []:
        echo(f"ftkit: would skip {v.reason}")
    if choice.exit_code is not None:
        echo(f"ftkit: error: {choice.refusal}")
        return choice.exit_code
    if choice.finished:
        echo(f"ftkit: {finished_line(choice.finished)}")
        return ExitCode.OK
    full = space_refusal(rd, choice)
    if full is not None:
        echo(f"ftkit: error: {full}")
        return ExitCode.NO_SPACE
    _check_changes(compute(plan), choice, req.allow_changes, echo)  # raises (exit 2) for a refused change
    where = f"resumes from {Path(choice.resume).name}" if choice.resume else "starts fresh"
    echo(f"dry run: a launch now {where}; the preflight (ssh to every host) is not run here: see `ftkit doctor`")
    return ExitCode.OK


def _user_command(
    plan: Plan, req: LaunchRequest, echo: Callable[[str], None], warn: Callable[[str], None]
) -> UserCommand | None:
    """The command every rank runs instead of the built-in entry (`-- CMD`, else train.command), or None."""
    import importlib.util
    import shutil

    r = plan.recipe
    argv = req.command if req.command is not None else r.train.command
    if argv is None:
        return None
    trl = importlib.util.find_spec("trl")
    trl_dir = str(Path(trl.origin).parent) if trl is not None and trl.origin else None
    cwd = os.getcwd()
    search = [cwd, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    command = parse_command(argv, cwd, shutil.which, trl_dir, find_module=lambda m: module_exists(m, search))
    if command.note:
        echo(f"ftkit: note: {command.note}")
    keys = builtin_only_keys(getattr(r, "explicit", set()))
    if keys:
        warn(
            f"ftkit: warning: {', '.join(keys)}: data.* and peft.* describe ftkit's built-in entry only; "
            "your command loads its own data and adapters, so ftkit does not apply them"
        )
    if not req.inject:
        echo("ftkit: note: --no-inject: the command gets no import hook; it must use ftkit.hf itself")
    return command


def _owned_launch(
    plan: Plan,
    req: LaunchRequest,
    echo: Callable[[str], None],
    command: UserCommand | None = None,
    replan: Callable[[bool], Plan] | None = None,
) -> int:

    r = plan.recipe
    rd = RunDir(r.train.output_dir)
    ssh_args = ssh_args_of(plan)
    ownership = Ownership(rd, ssh_args)
    ownership.acquire(takeover=req.takeover, teardown=lambda left: stop_leftovers(left, ssh_args, echo), echo=echo)
    try:
        # preflight plus doctor's cheap checks on every host at once (versions, space, /dev/shm, clock, interface,
        # stale build locks); `ftkit doctor` adds the rendezvous and all-reduce

        transport = transport_for(r.cluster.engine, os.environ)
        report = cheap_checks(plan, ssh_args, transport=transport)
        # DeepSpeed's compiled ops: what the optimizer needs, as every host allows; what must be built, once per host
        if replan is not None:
            plan, note = settle_optimizer(plan, report.toolchain, replan)
            if note:
                echo(f"ftkit: {note}")
        report.checks += warm_up(
            plan,
            report.toolchain,
            env=build_env(dict(os.environ), plan),
            python=sys.executable,
            ssh_args=ssh_args,
            deadline_s=float(r.resilience.startup_timeout_s),
            transport=transport,
        )
        sup = Supervisor(supervisor_config(plan, rd, ssh_args, echo, command, req.inject))
        choice = sup.resume.select(step_limits(plan))
        if choice.exit_code is not None:
            sup.events.attempt = sup.rd.next_attempt()
            return sup.resume.apply(choice).exit_code or ExitCode.NO_CHECKPOINT
        if choice.finished:
            sup.events.attempt = sup.rd.next_attempt()
            sup.tier.end()  # what an earlier launch left (its ranks finished without their supervisor)
            sup.events("finished", finished_line(choice.finished))
            return ExitCode.OK
        full = space_refusal(rd, choice)
        if full is not None:
            raise NoSpace(full)

        fingerprint = compute(plan)  # hashes the data file: once per launch
        overrides, changes = _check_changes(fingerprint, choice, req.allow_changes, echo)
        argv = command.display() if command else None  # what the ranks run, `-- CMD` included
        prepare_run(plan, resume_overrides=overrides, fingerprint=fingerprint, command=argv)
        sup.events.attempt = sup.rd.next_attempt()
        if ownership.taken_over:
            sup.events("takeover", f"took the run over: stopped {len(ownership.taken_over)} orphaned rank(s)")
        if changes:
            sup.events("resume_changes", None, changes=changes)
        # Recomputed steps legitimately differ after any applied change (a new max_steps reshapes the schedule).
        sup.check_fidelity = not changes
        sup.events("preflight", "preflight passed: " + "; ".join(report.checks), versions=report.versions)

        sup.events("plan", None, **plan_record(plan))  # ftkit report reads the plan's figures from events.jsonl
        sup.reports = launch_refresher(rd, echo)
        code = sup.run(first=choice)
    finally:
        ownership.release()

    try:
        echo(format_summary(summarize(rd.path)))
    except (OSError, ValueError) as e:
        echo(f"ftkit: cannot summarise {rd.path}: {e}")
    return code


def step_limits(plan: Plan) -> StepLimits:
    return StepLimits(plan.recipe.train.max_steps, plan.recipe.train.epochs)


def finished_line(where: str) -> str:
    return (
        f"the run is already finished ({where}, as the recipe's step limits ask): nothing to do; raise "
        "train.max_steps (or train.epochs) to train on, or set another train.output_dir"
    )


def _check_changes(
    fingerprint: Fingerprint, choice: Choice, allow: Iterable[str], echo: Callable[[str], None]
) -> tuple[dict[str, JSON], list[dict[str, JSON]]]:
    """Compare what shapes training now with what the chosen checkpoint was saved with; refuse (exit 2, nothing
    written) what the user did not allow. Returns the spec's resume_overrides and the changes for events.jsonl."""

    allow = [k.strip() for item in allow for k in item.split(",") if k.strip()]
    if choice.resume is None:
        if allow:
            echo("ftkit: note: --allow-changes has no effect: nothing to resume from")
        return {}, []
    recorded = ((choice.record or {}).get("extra") or {}).get("fingerprint")
    check = compare(recorded, fingerprint, allow)
    for note in check.notes:
        echo(f"ftkit: note: {note}")
    check.raise_if_refused()
    for line in check.lines():
        echo(f"ftkit: changed since {Path(choice.resume).name}: {line}")
    return check.overrides(), [c.to_json() for c in check.applied]


@dataclass(frozen=True)
class Replan:
    """Continuing on fewer hosts (:class:`ftkit.supervise.resume.Replanner`): the recipe planned again on the hosts
    left, and the run's configs and spec written for a plan."""

    recipe: Recipe
    cpu_adam_ok: bool | None  # the preflight's finding of DeepSpeed's CPU Adam, kept for the new plan
    command: list[str] | None  # the user's command as the spec records it (None: the built-in entry)

    def replan(self, hosts: list[tuple[str, int]]) -> Plan:
        return build_plan(self.recipe, hosts=hosts, cpu_adam_ok=self.cpu_adam_ok)

    def prepare(self, plan: Plan, load_universal: bool) -> object:
        return prepare_run(plan, load_universal=load_universal, command=self.command)


def supervisor_config(
    plan: Plan,
    rd: RunDir,
    ssh_args: list[str],
    echo: Callable[[str], None],
    command: UserCommand | None = None,
    inject: bool = True,
) -> SupervisorConfig:
    """The one place a supervisor's configuration is made from a plan."""

    r = plan.recipe
    return SupervisorConfig(
        rd=rd,
        inputs=launch_inputs(plan, command=command, inject=inject),
        base_env=dict(os.environ),
        resilience=r.resilience,
        stage=plan.stage,
        world_size=plan.world_size,
        max_steps=r.train.max_steps,
        global_batch=plan.global_batch_size,
        logging_steps=r.train.logging_steps,
        ssh_args=ssh_args,
        echo=echo,
        min_nodes=r.cluster.min_nodes,
        replanner=Replan(r, plan.cpu_adam_ok, command.display() if command else None),
    )


def dry_run(plan: Plan, command: UserCommand | None = None, inject: bool = True) -> str:
    """What a launch would start (per-node argv and environment), and who owns the run directory now. Reads only."""

    rd = RunDir(plan.recipe.train.output_dir)
    lines = []
    resume = None
    if rd.path.is_dir():
        # Sizes only here: the verdict that follows (as the launch decides) verifies every byte.
        sel = select_resume(rd.path, checksums=False, world_size=plan.world_size, stage=plan.stage)
        resume = str(sel.chosen) if sel.chosen else None
    inputs = launch_inputs(plan, rd.next_attempt(), resume, command=command, inject=inject)
    if inputs.inject_path:
        lines.append(f"import hook: {inputs.inject_path}/sitecustomize.py first on the ranks' PYTHONPATH (--no-inject)")
    lines.append(describe(build_launch(inputs, dict(os.environ))))
    return "\n".join(lines)
