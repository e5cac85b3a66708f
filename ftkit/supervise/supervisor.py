"""Supervision as a fixed script: choose checkpoint → spawn → monitor → tear down → decide → (back off, again).

* **choose** (:func:`ftkit.supervise.choose.select`, read-only) walks the checkpoints newest first and takes the
  first whose commit record verifies, every byte checked; :meth:`Supervisor.apply` then logs the rejected ones and
  sets newer torn ones aside, so the resumed run can write that step again. With a local checkpoint tier, a newer
  step verified on every node's tier (or assembled from peer copies) wins (:mod:`ftkit.supervise.tiers`).
* **spawn** starts the engine's processes (:mod:`ftkit.supervise.attempt`); **monitor** watches their exits, every
  rank's heartbeat (:class:`ftkit.supervise.decide.Progress`), error records, and what
  :mod:`ftkit.supervise.observe` reads (metrics, resume fidelity, stragglers).
* **graceful stop**: the first SIGTERM/SIGINT/SIGHUP/SIGUSR1 (``ftkit stop``, Ctrl-C, Slurm's notice) writes
  ``ftkit/stop.json``; every rank sees it at the same optimizer step (:mod:`ftkit.hf`), saves and commits that
  step and ends; then teardown, and exit 8. Bounded by ``resilience.stop_timeout_s``; past it, or on a second
  signal, the run is torn down at once (exit 128+N).
* **teardown** stops the whole run on every host by process group and recorded pid (SIGTERM, grace, SIGKILL) and
  removes its /dev/shm buffers. It runs in a ``finally``: no exception between spawn and teardown leaves ranks
  holding the GPUs.
* **decide** is :func:`ftkit.supervise.decide.decide`, a pure function: restart, shrink onto the remaining hosts
  (:mod:`ftkit.supervise.shrink`), or stop with a documented exit code.

Every decision is a line in ``events.jsonl``. A full disk ends the run with "no space left on <path>" (exit 12).
At the end, whatever the outcome, the local tier's newest step is copied to the run directory and the tier removed.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Protocol

from ftkit.checkpoint.directory import list_checkpoints, select_resume, set_aside_newer
from ftkit.checkpoint.layout import read_commit
from ftkit.checkpoint.tiers import node_dir, set_records
from ftkit.checkpoint.verify import verify
from ftkit.cluster.hosts import is_local
from ftkit.cluster.procs import exit_meaning, is_alive
from ftkit.cluster.slurm import transport_for
from ftkit.command.engines import LaunchCommand, LaunchInputs, build_launch
from ftkit.errors import ExitCode, UserError
from ftkit.rundir.failures import BY_NAME, DS_SHM_BYTES_PER_RANK, SCRIPT_EXIT, free_bytes
from ftkit.rundir.layout import NEARLY_FULL, STOP_FILE, RunDir, append_jsonl, atomic_write, read_metrics
from ftkit.rundir.spec import LocalTierSpec, RunSpec
from ftkit.supervise.attempt import Spawned, spawn, teardown_attempt
from ftkit.supervise.cause import Cause, attempt_cause
from ftkit.supervise.choose import Choice, StepLimits, select
from ftkit.supervise.decide import Action, Decision, FailureKind, Progress, RestartPolicy, Situation, decide
from ftkit.supervise.fidelity import FidelityCheck
from ftkit.supervise.observe import Observer, log_tail, root_cause
from ftkit.supervise.shrink import convert_newest, probe_hosts
from ftkit.supervise.stragglers import hosts_to_exclude, record_step_times
from ftkit.supervise.tiers import Agents, TierChoice, choose_tier, discard_stale, end_local_tier

if TYPE_CHECKING:
    from ftkit.plan.plan import Plan
    from ftkit.rundir.records import ErrorRecord, Heartbeat
    from ftkit.rundir.sections import ResilienceSection

# A closed terminal (SIGHUP) is handled like SIGTERM; SIGUSR1 is Slurm's advance notice (--signal=B:USR1@T).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
STOP_TIMEOUT_S = 120.0  # resilience.stop_timeout_s when a recipe predates it


def is_no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


class Events:
    """Append decisions to events.jsonl and echo their message. A write that fails (a full disk) is remembered in
    ``write_error`` and the message still reaches the terminal."""

    def __init__(self, rd: RunDir, echo: Callable[[str], None]):
        self.rd = rd
        self.echo = echo
        self.attempt = 0
        self.write_error: OSError | None = None

    def __call__(self, event: str, message: str | None = None, /, **data: object) -> None:
        rec: dict[str, object] = {"time": round(time.time(), 3), "event": event, "attempt": self.attempt, **data}
        if message:
            rec["message"] = message
        try:
            append_jsonl(self.rd.events, rec)
        except OSError as e:
            self.write_error = self.write_error or e
        if message:
            self.echo(f"ftkit: {message}")


@dataclass
class Failure:
    kind: FailureKind
    message: str
    step: int | None = None
    exit_code: int | None = None
    lines: list[str] = field(default_factory=list)  # what the ranks reported (user errors, no space)
    traceback: list[str] = field(default_factory=list)  # the last lines of a failing script's traceback
    cause: Cause | None = None  # why, when the ranks' records or logs say (ftkit.supervise.cause)

    @property
    def failure_class(self) -> str:
        """events.jsonl's name for why it failed (ftkit.rundir.failures), else the kind of failure."""
        return self.cause.cls.name if self.cause is not None else self.kind.value

    def with_traceback(self, tb: list[str]) -> Failure:
        self.traceback = tb
        return self


class Reports(Protocol):
    """What refreshes ``RUN/report.html`` during a launch (:class:`ftkit.report.ReportRefresher`)."""

    def refresh(self) -> None: ...
    def finish(self) -> None: ...


class Supervisor:
    def __init__(
        self,
        *,
        rd: RunDir,
        inputs: LaunchInputs,
        base_env: Mapping[str, str],
        resilience: ResilienceSection,
        stage: int,
        world_size: int,
        max_steps: int | None,
        ssh_args: list[str],
        echo: Callable[[str], None] = print,
        poll_s: float = 0.5,
        grace_s: float = 10.0,
        rng: random.Random | None = None,
        min_nodes: int | None = None,
        logging_steps: int = 1,
        replan: Callable[[list[tuple[str, int]]], Plan] | None = None,
        prepare: Callable[[Plan, bool], object] | None = None,
        global_batch: int | None = None,
    ):
        self.rd = rd
        self.min_nodes = min_nodes
        self.replan = replan  # hosts -> Plan (raises UserError when the global batch cannot be kept)
        self.prepare = prepare  # (Plan, load_universal) -> writes the run's configs and spec
        self._convert_from_world: int | None = None  # set after a shrink: checkpoints of that size get converted
        self.inputs = inputs
        self.base_env = dict(base_env)
        self.res = resilience
        self.stage = stage
        self.world_size = world_size
        self.max_steps = max_steps
        self.logging_steps = logging_steps
        self.ssh_args = ssh_args

        self.transport = transport_for(inputs.engine, base_env)
        self.echo = echo
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.observer = Observer(rd, self._event, max_steps=max_steps, global_batch=global_batch or world_size)
        self.events = Events(rd, self._say)
        self.policy = RestartPolicy(
            self.res.max_restarts, self.res.backoff_s, self.res.backoff_max_s, rng or random.Random()
        )
        self.interrupted: int | None = None  # a signal that ends the run now (the second one)
        self.stop_requested: int | None = None  # the first signal: save at the next step, then stop
        self._stop_sent_at: float | None = None
        self.check_fidelity = True  # off for an attempt that resumes with changes the user allowed
        self._plan: Plan | None = None
        self._universal_attempt = False
        self._exclude: list[str] = []  # stragglers a graceful stop is leaving out (resilience.exclude_stragglers)
        self._unwatched = False  # this attempt's script built no Trainer and calls no ftkit.hf.step(): not restarted
        self._resumed_from: tuple[int | None, str] | None = None  # (step, checkpoint name) this attempt resumed from
        self._beats: list[Heartbeat] = []  # the newest poll's heartbeats of the running attempt
        self._peer_step: int | None = None  # the step the survivors assembled from peer copies for this attempt
        # refreshes RUN/report.html after each attempt (ftkit.report.ReportRefresher; the launch sets it)
        self.reports: Reports | None = None

    # ------------------------------------------------------------------------------------------------ choose

    def select(self, limits: StepLimits | None = None) -> Choice:
        """Read-only: the checkpoint to resume from, or why the run cannot continue. Writes nothing. ``limits``
        (the recipe's step limits, at launch): a run already finished for them says so."""
        return select(
            self.rd,
            checksums=self.res.verify_checksums,
            world_size=self.world_size,
            stage=self.stage,
            max_steps=self.max_steps,
            convert_from_world=self._convert_from_world,
            limits=limits,
        )

    def apply(self, choice: Choice, announce: bool = True) -> Choice:
        """Carry a choice out: log the rejected checkpoints, set newer torn ones aside, convert after a shrink.
        ``announce=False``: the checkpoint resumed from is said by the caller (a local tier's step)."""
        sel = choice.selection
        for v in sel.rejected if sel else []:
            self.events(
                "checkpoint_rejected",
                f"skipping {v.reason}",  # the reason starts with the checkpoint's name
                checkpoint=str(v.path),
                reason=v.reason,
                kind=v.kind,
            )
        if choice.exit_code is not None:
            self.events("refused", choice.refusal)
            return choice
        assert sel is not None
        if choice.convert:
            converted = convert_newest(sel, sel.incompatible, self.world_size, self.events)
            if isinstance(converted, int):
                return Choice(sel, exit_code=converted, refusal="conversion refused")
            if converted is not None:
                if self.prepare is not None and self._plan is not None:
                    self.prepare(self._plan, True)
                    self._universal_attempt = True
                v = max(sel.incompatible, key=lambda x: x.step or -1)
                return Choice(sel, converted, v.step, v.record)
        for dst in set_aside_newer(self.rd.path, sel):
            self.events("set_aside", f"moved {dst.name.split('.rejected')[0]} aside to {dst.name}", dst=str(dst))
        if not announce:
            pass
        elif sel.chosen is None:
            self.events("fresh_start", None)
        else:
            last = self.max_steps is not None and sel.step == self.max_steps
            self.events(
                "checkpoint_chosen",
                f"resuming from {sel.chosen.name} (step {sel.step}, commit verified)"
                + (": it is train.max_steps, so the ranks write final/ from it without training" if last else ""),
                checkpoint=str(sel.chosen),
                step=sel.step,
            )
        return choice

    # ------------------------------------------------------------------------------------------------ phases

    def spawn(self, cmd: LaunchCommand, attempt: int, out: list[Spawned]) -> None:
        """Start every node's process; each is appended to ``out`` as it starts (teardown needs even a partial
        list)."""
        spawn(cmd, attempt, self.rd, self.events, out)

    def monitor(self, procs: list[Spawned], attempt: int, started: float) -> Failure | None:
        """Until success (None) or the first failure. Heartbeat changes are timed by this clock (no skew)."""
        progress = Progress(started, float(self.res.startup_timeout_s), float(self.res.hang_timeout_s))
        while True:
            if self.interrupted:
                return Failure(FailureKind.INTERRUPTED, f"interrupted by {signal.Signals(self.interrupted).name}")
            if self.events.write_error is not None and is_no_space(self.events.write_error):
                return self._no_space_failure(self.events.write_error)
            now = time.monotonic()
            beats = [hb for hb in self.rd.heartbeats() if hb.get("attempt") == attempt]
            self._beats = beats
            if self.stop_requested or self._exclude:  # decided on this poll's heartbeats, never an older poll's
                stopping = self._stopping(attempt, beats)
                if stopping is not None:
                    return stopping
            mismatch = self.observer.poll(attempt, beats, now, progress.phases)
            if mismatch:
                return Failure(FailureKind.RESUME_MISMATCH, mismatch, step=self._step(attempt))
            earlier = not_resumed(beats, self._resumed_from)
            if earlier:
                return Failure(FailureKind.NOT_RESUMED, earlier, step=self._step(attempt))
            self._exclude_stragglers()
            codes = [p.proc.poll() for p in procs]
            errors = self.rd.records("errors", attempt)
            if errors:
                return self._error_failure(errors, attempt)
            bad = [(p, c) for p, c in zip(procs, codes, strict=True) if c not in (None, 0)]
            if bad and self._stop_sent_at is not None:
                return Failure(
                    FailureKind.INTERRUPTED,
                    f"a rank ended during the graceful stop ({exit_meaning(bad[0][1])}): the stop's save may be torn",
                    step=self._step(attempt),
                )
            if bad:
                p, c = bad[0]
                time.sleep(0.3)  # let a rank finish writing its error record before we look again
                if self.rd.records("errors", attempt):
                    continue
                full = self._full_device()  # a rank that could not even write its error record
                if full is not None:
                    return Failure(
                        FailureKind.NO_SPACE,
                        f"node {p.node_rank} ({p.host}) engine ended: {exit_meaning(c)}; {full[0]} is full",
                        step=self._step(attempt),
                        exit_code=c,
                        lines=[f"no space left on {full[0]}{full[1]}"],
                    )
                return Failure(
                    FailureKind.EXIT,
                    f"node {p.node_rank} ({p.host}) engine ended: {exit_meaning(c)}" + root_cause(p.log),
                    step=self._step(attempt),
                    exit_code=c,
                    cause=attempt_cause(self.rd, attempt, c, self._own_dirs()),
                )
            if all(c == 0 for c in codes):
                if self._stop_sent_at is not None and not self._final_committed(attempt):
                    return Failure(FailureKind.STOPPED, "every rank saved and stopped", step=self._step(attempt))
                return None
            progress.observe(beats, now)
            found = progress.failure(now, self._step(attempt))
            if found and found[0] is FailureKind.STARTUP and unwatchable(beats, self.world_size):
                self._unwatched = True  # healthy, just invisible: let it run to its end, do not restart it
                progress.startup_timeout_s = float("inf")
                self.events("unwatched", UNWATCHED)
                found = None
            if found:
                return Failure(found[0], found[1], step=self._step(attempt))
            time.sleep(self.poll_s)

    def _error_failure(self, errors: list[ErrorRecord], attempt: int) -> Failure:
        lines = [str(line) for e in errors for line in (e.get("lines") or [])]
        lines = sorted(set(lines), key=lines.index)
        if any(e.get("exit_code") == ExitCode.NO_SPACE for e in errors):
            return Failure(FailureKind.NO_SPACE, "a rank ran out of disk space", lines=lines)
        script = [e for e in errors if e.get("exit_code") == ExitCode.SCRIPT_FAILED]
        if script:
            e = script[0]
            tb = [str(x) for x in (e.get("traceback") or [])]
            where = f"rank {e.get('rank')} on {e.get('host')}"
            cls = BY_NAME.get(str(e.get("failure_class")), SCRIPT_EXIT)
            log = str(self.rd.rank_log(attempt, int(e.get("rank") or 0)))
            cause = Cause(cls, e.get("summary"), e.get("rank"), e.get("host"), log)
            if e.get("repeats"):  # deterministic at any step (a save that writes nothing): stop at once
                return Failure(
                    FailureKind.SCRIPT_ERROR, f"the training script on {where}", lines=lines, exit_code=14, cause=cause
                )
            if e.get("step") is None and not e.get("restartable"):  # before the first step: it would happen again
                return Failure(
                    FailureKind.SCRIPT_ERROR,
                    f"the training script failed on {where}",
                    lines=lines,
                    exit_code=14,
                    cause=cause,
                ).with_traceback(tb)
            if e.get("step") is None:  # a cause a restart may change (a peer, the network): restarted
                return Failure(
                    FailureKind.EXIT,
                    f"the training script failed on {where} before its first step",
                    exit_code=ExitCode.SCRIPT_FAILED,
                    cause=cause,
                ).with_traceback(tb)
            # after it: an ordinary failure (restarted; the no-progress rule stops a repeating one)
            return Failure(
                FailureKind.EXIT,
                f"the training script raised on {where} at step {e.get('step')}",
                step=self._step(attempt),
                exit_code=ExitCode.SCRIPT_FAILED,
                cause=cause,
            ).with_traceback(tb)
        return Failure(FailureKind.USER_ERROR, "a rank reported an error a restart cannot fix", lines=lines)

    def _no_space_failure(self, e: OSError) -> Failure:
        return Failure(FailureKind.NO_SPACE, "ftkit ran out of disk space", lines=[f"no space left on {e.filename}"])

    def teardown(self, procs: list[Spawned], attempt: int) -> None:
        """Everything of the attempt stops, on every host: by process group and recorded pid, then /dev/shm."""
        teardown_attempt(
            procs, attempt, self.rd, self.events, grace_s=self.grace_s, ssh_args=self.ssh_args, transport=self.transport
        )

    def shrink(self, lost: list[str]) -> int | None:
        """Replan on the hosts that are left (keeping the global batch); an exit code when that is impossible."""

        remaining = [(h, n) for h, n in self.inputs.hosts if h not in lost]
        if self.replan is None:
            return ExitCode.HOST_LOST
        try:
            plan = self.replan(remaining)
        except UserError as e:
            self.events("gave_up", f"cannot continue on {', '.join(h for h, _ in remaining)}: {e.lines()[0]}")
            return ExitCode.HOST_LOST
        self._plan = plan
        if self.prepare is not None:
            self.prepare(plan, False)
        self._convert_from_world = self.world_size
        self.world_size = plan.world_size
        self.inputs = LaunchInputs(
            **{**self.inputs.__dict__, "hosts": tuple(plan.hosts), "master_addr": plan.master_addr}
        )
        self.events(
            "shrink",
            f"continuing on {', '.join(h for h, _ in plan.hosts)}: world size {plan.world_size}, global batch "
            f"{plan.global_batch_size} kept with gradient accumulation {plan.grad_accum}",
            hosts=[list(h) for h in plan.hosts],
            world_size=plan.world_size,
            global_batch_size=plan.global_batch_size,
            gradient_accumulation_steps=plan.grad_accum,
        )
        return None

    # ------------------------------------------------------------------------------------------------ script

    def run(self, first: Choice | None = None) -> int:
        """The whole job. ``first``: the choice the launcher already made (and checked) for the first attempt."""
        old = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        code: int | None = None
        # files holding the ranks' environment (DeepSpeed's env file) live outside the run directory, readable by
        # this user only, for this launch only
        private = tempfile.mkdtemp(prefix="ftkit-env-")
        self.inputs = LaunchInputs(**{**self.inputs.__dict__, "private_dir": private})
        try:
            code = self._run(first)
            return code
        except OSError as e:
            if not is_no_space(e):
                raise
            self.echo(f"ftkit: error: no space left on {e.filename or self.rd.path}")
            self.events("gave_up", f"no space left on {e.filename or self.rd.path}", kind=FailureKind.NO_SPACE.value)
            code = ExitCode.NO_SPACE
            return code
        finally:
            shutil.rmtree(private, ignore_errors=True)
            self.end_local_tier()
            self.observer.finish()
            for s, h in old.items():
                signal.signal(s, h)
            try:
                (self.rd.meta / STOP_FILE).unlink()
            except OSError:
                pass
            if self.reports is not None:
                self.reports.finish()  # the page with the launch's last events; a bounded wait

    def _run(self, first: Choice | None) -> int:
        attempt = self.rd.next_attempt()
        if self.rd.metrics.exists():
            self._metrics_pos = self.rd.metrics.stat().st_size
        while True:
            self.events.attempt = attempt
            choice, local = self._choose_tier(first if first is not None else self.select())
            first = None
            choice = self.apply(choice, announce=local is None)
            if choice.exit_code is not None:
                return choice.exit_code
            if local is not None:
                choice = self._resume_local(choice, local)
            self._discard_stale(choice.step)
            tier = "local" if local is not None else self._tier_of(choice)
            if self.interrupted or self.stop_requested:
                return self._stop_between_attempts()
            self._exclude, self._stop_sent_at, self._unwatched = [], None, False
            self._resumed_from = (choice.step, Path(choice.resume).name) if choice.resume else None
            self._start_fidelity(attempt, choice.step)
            inputs = LaunchInputs(**{**self.inputs.__dict__, "attempt": attempt, "resume": choice.resume})
            cmd = build_launch(inputs, self.base_env)
            self.events(
                "launch",
                f"attempt {attempt}: starting {cmd.engine} on {', '.join(h for h, _ in inputs.hosts)}"
                + (f", resuming from {Path(choice.resume).name} ({tier} tier)" if choice.resume else ""),
                engine=cmd.engine,
                resume=choice.resume,
                step=choice.step,
                tier=tier if choice.resume else None,
            )
            procs: list[Spawned] = []
            try:
                self.spawn(cmd, attempt, procs)
                failure = self.monitor(procs, attempt, time.monotonic())
                if failure is not None and failure.kind is not FailureKind.STOPPED:
                    self._record_failure(failure, attempt)
            finally:
                self.teardown(procs, attempt)  # whatever happened above: nothing of the run is left running
            record_step_times(self.rd, attempt, self.events)  # for ftkit report: the next attempt overwrites them
            if failure is None:
                if not self._final_committed(attempt) and (self._unwatched or unwatchable(self._beats, 1)):
                    self.events("finished", "the script ended (exit 0); " + UNWATCHED_END)
                    return ExitCode.OK
                if not self._final_committed(attempt):
                    self.events("failed", "the engine exited 0 but no committed final model was written")
                    return ExitCode.TRAINING_FAILED
                self.events("finished", f"finished: final model in {self.rd.final}", step=self._step(attempt))
                return ExitCode.OK
            decision = self._decide(failure, attempt)
            if not decision.restart:
                return self._stop(decision)
            if decision.action is Action.SHRINK:
                code = self.shrink(self._lost)
                if code is not None:
                    return code
            self.events("restart", decision.reason, restarts=self.policy.used, delay_s=round(decision.delay_s, 2))
            if self.reports is not None:
                self.reports.refresh()  # a detached render: it overlaps the backoff and the next start-up
            deadline = time.monotonic() + decision.delay_s
            while time.monotonic() < deadline and not (self.interrupted or self.stop_requested):
                time.sleep(0.1)
            if self.interrupted or self.stop_requested:
                return self._stop_between_attempts()
            if self._universal_attempt and self.prepare is not None and self._plan is not None:
                self.prepare(self._plan, False)  # later attempts load the new world size's own checkpoints
                self._universal_attempt = False
            attempt += 1

    def _stop_between_attempts(self) -> int:
        """A signal while nothing runs: nothing is in flight, so the newest committed checkpoint is where the run
        is (exit 8); a second signal, or none committed, is an interruption as before (128+N)."""
        if self.interrupted or self._newest_commit() is None:
            return self._stop(
                decide(Situation(FailureKind.INTERRUPTED, signum=self.interrupted or self.stop_requested), self.policy)
            )
        return self._stop(
            decide(
                Situation(FailureKind.STOPPED, signum=self.stop_requested, newest_commit=self._newest_commit()),
                self.policy,
            )
        )

    def _record_failure(self, failure: Failure, attempt: int) -> None:
        self.events(
            "failure",
            f"attempt {attempt} failed: {failure.message}",
            kind=failure.kind.value,
            failure_class=failure.failure_class,
            restartable=failure.cause.cls.restartable if failure.cause is not None else None,
            cause=failure.cause.describe() if failure.cause is not None and failure.cause.line else None,
            step=failure.step,
            exit_code=failure.exit_code,
            exit_meaning=exit_meaning(failure.exit_code) if failure.exit_code is not None else None,
            dead_ranks=self._dead_ranks(attempt),
        )

    def _decide(self, failure: Failure, attempt: int) -> Decision:
        if failure.kind is FailureKind.STOPPED and self._exclude and not self.stop_requested:
            self._lost = list(self._exclude)  # saved and stopped to leave the stragglers out: continue without them
            return self.policy.on_failure(failure.step, self._newest_commit(), Action.SHRINK)
        for line in failure.lines:
            self.echo(f"ftkit: error: {line}")
        if failure.traceback:
            self.echo("  the script's traceback (last lines):")
            for line in failure.traceback:
                self.echo(f"    {line[:300]}")
        if failure.kind is FailureKind.NO_SPACE:
            self._discard_torn()
        self._lost = []
        if failure.kind in (FailureKind.EXIT, FailureKind.HANG, FailureKind.STARTUP) and not failure.traceback:
            log_tail(self.rd, attempt, self._say)
        if failure.kind in (FailureKind.EXIT, FailureKind.HANG, FailureKind.STARTUP):
            self._lost = probe_hosts(list(self.inputs.hosts), self.ssh_args, transport=self.transport)
            if self._lost:
                self.events(
                    "host_lost", f"lost host(s) {', '.join(self._lost)}: not reachable over ssh", hosts=self._lost
                )
        situation = Situation(
            failure.kind,
            detail=failure.message,
            step=failure.step,
            newest_commit=self._newest_commit(),
            signum=self.interrupted or self.stop_requested,
            lost_hosts=tuple(self._lost),
            nodes=len(self.inputs.hosts),
            min_nodes=self.min_nodes,
        )
        if failure.cause is not None:
            situation = dataclasses.replace(
                situation,
                cause=failure.cause.cls.name,
                restartable=failure.cause.cls.restartable,
                signature=failure.cause.signature,
                cause_line=failure.cause.describe(),
                hint=failure.cause.cls.hint,
            )
        return decide(situation, self.policy)

    def _stop(self, decision: Decision) -> int:
        event = {129: "interrupted", 130: "interrupted", 138: "interrupted", 143: "interrupted"}.get(
            decision.exit_code, "stopped" if decision.exit_code == ExitCode.STOPPED else "gave_up"
        )
        self.events(event, decision.reason, restarts=self.policy.used, exit_code=decision.exit_code)
        return decision.exit_code

    # ------------------------------------------------------------------------------------------------ helpers

    def _start_fidelity(self, attempt: int, resume_step: int | None) -> None:
        fidelity = None
        if resume_step is not None and self.check_fidelity:
            fidelity = FidelityCheck.from_metrics(
                read_metrics(self.rd.metrics),
                attempt,
                float(self.res.resume_tolerance),
                self.logging_steps,
                resume_step,
            )
        self.observer.start_attempt(attempt, fidelity)

    def _discard_torn(self) -> None:
        """After a full disk: delete uncommitted checkpoints newer than the newest committed one. They can never be
        resumed from, and keeping them keeps the disk full; committed ones are untouched."""
        newest = self._newest_commit()
        for step, path in list_checkpoints(self.rd.path):
            if (newest is None or step > newest) and not verify(path, False, require_commit=True).committed:
                doomed = path.with_name(f".deleting-{path.name}")
                try:
                    path.rename(doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
                    self.events("discarded", f"deleted {path.name}: torn by the full disk, never committed")
                except OSError:
                    pass

    def _own_dirs(self) -> list[str]:
        """Where ftkit keeps files besides the run directory: the local tier's root (before its ``{host}``)."""
        tier = self._tier()
        return [tier["dir"].split("{host}")[0].rstrip("/")] if tier and tier.get("dir") else []

    def _full_device(self) -> tuple[str, str] | None:
        """(a full place this machine's ranks write to, why it matters), checked when ranks die without a record:
        the run directory, this machine's local checkpoint tier, and on the cpu accelerator /dev/shm, where
        DeepSpeed's collectives map 66 MiB per rank (a tmpfs too small for them kills every rank with SIGBUS or
        SIGSEGV at its first collective, and every restart would do the same)."""
        places = [(str(self.rd.path), "")]
        tier = self._tier()
        if tier:
            places += [(str(node_dir(tier["dir"], h)), "") for h, _ in self.inputs.hosts if is_local(h)]
        if self.inputs.accelerator == "cpu" and Path("/dev/shm").is_dir():
            per_rank = DS_SHM_BYTES_PER_RANK >> 20
            places.append(("/dev/shm", f": DeepSpeed's CPU collectives map {per_rank} MiB per rank there"))
        for path, why in places:
            if free_bytes(path) < NEARLY_FULL:
                return path, why
        return None

    def _step(self, attempt: int) -> int | None:
        found = [hb.get("step") for hb in self.rd.heartbeats() if hb.get("attempt") == attempt]
        steps = [s for s in found if isinstance(s, int)]
        return max(steps) if steps else None

    def _final_committed(self, attempt: int) -> bool:
        """final/ committed by *this* attempt: a relaunch of a finished run finds the old record still there."""
        try:
            rec = read_commit(self.rd.final)
        except (OSError, ValueError):
            return False
        if not rec:
            return False
        return (rec.get("extra") or {}).get("attempt") == attempt

    def _newest_commit(self) -> int | None:
        # Sizes only: this feeds the no-progress rule; the resume choice itself (select) reads every byte. A step
        # every node committed in its local tier counts too (the next attempt resumes from it when it verifies).
        sel = select_resume(
            self.rd.path, checksums=False, require_commit=True, world_size=self.world_size, stage=self.stage
        )
        local = [r["step"] for r in set_records(self.rd.path)] if self._tier() else []
        steps = [s for s in [sel.step, *local] if s is not None]
        return max(steps) if steps else None

    # ------------------------------------------------------------------------------------------------ tiers

    def _tier(self) -> LocalTierSpec | None:
        """The run's local checkpoint tier as the spec has it now (a shrink rewrites the spec), None: off."""
        try:
            return RunSpec.read(self.rd.spec).local_tier
        except (OSError, ValueError, TypeError):
            return None

    def _agents(self) -> Agents:
        return Agents(self.rd, self.inputs.python, self.ssh_args, self.transport)

    def _choose_tier(self, choice: Choice) -> tuple[Choice, TierChoice | None]:
        """Before the durable choice is carried out: a newer step verified in every node's local tier (returned
        apart), or one the survivors assemble in the run directory from peer copies (then the choice is made again:
        it is durable now, and converted after a shrink like any other)."""
        tier = self._tier()
        self._peer_step = None
        if not tier or choice.exit_code is not None:
            return choice, None
        hosts = [h for h, _ in self.inputs.hosts]
        picked = choose_tier(
            self.rd, tier, hosts, self.world_size, choice.step, self.max_steps, self._agents(), self.events
        )
        if picked is None:
            return choice, None
        if picked.tier == "peer":
            self._peer_step = picked.step
            return self.select(), None
        return choice, picked

    def _discard_stale(self, step: int | None) -> None:
        tier = self._tier()
        if tier:
            discard_stale(self.rd, [h for h, _ in self.inputs.hosts], step, self._agents(), self.events)

    def _resume_local(self, choice: Choice, local: TierChoice) -> Choice:
        if self._universal_attempt and self.prepare is not None and self._plan is not None:
            self.prepare(self._plan, False)  # the durable choice was converted; a local part is this world size's
            self._universal_attempt = False
        self.events(
            "checkpoint_chosen",
            f"resuming from checkpoint-{local.step} in the local tier (commit verified on every node)",
            checkpoint=local.resume,
            step=local.step,
            tier="local",
        )
        return Choice(choice.selection, local.resume, local.step, None)

    def _tier_of(self, choice: Choice) -> str:
        """Where a resume that is not the local tier's comes from: peer copies assembled this time, or durable."""
        if self._peer_step is not None and choice.step == self._peer_step:
            return "peer"
        return "durable"

    def end_local_tier(self) -> None:
        """Copy what is due from the local tier and remove it (the end of a launch; also a relaunch that finds the
        run finished: an orphan-finished run's tier may still be there)."""
        tier = self._tier()
        if not tier:
            return
        try:
            end_local_tier(self.rd, tier, list(tier.get("nodes") or []), self._agents(), self.events)
        except Exception as e:  # noqa: BLE001 - the launch's outcome stands; say what was left
            self.events("tier_left", f"could not end the local tier: {type(e).__name__}: {e}")

    def _say(self, text: str) -> None:
        """A line for the user: above the progress line on a terminal (it is rewritten in place there)."""
        if self.observer.progress.tty:
            self.observer.echo(text)
        else:
            self.echo(text)

    def _event(self, event: str, message: str | None = None, /, **data: object) -> None:
        self.events(event, message, **data)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:  # noqa: ARG002
        if self.stop_requested is None:
            self.stop_requested = signum  # the first: save at the next step boundary, then stop
        else:
            self.interrupted = signum  # the second: tear down now

    # ------------------------------------------------------------------------------------------------ graceful stop

    def _stopping(self, attempt: int, beats: list[Heartbeat]) -> Failure | None:
        """Called every poll once a stop is requested: ask the ranks (once), then bound the wait. Only when no rank
        has begun training (still starting or loading: no step can have completed) does it stop at once."""
        name = signal.Signals(self.stop_requested).name if self.stop_requested else "straggler"
        now = time.monotonic()
        timeout = float(self.res.stop_timeout_s or STOP_TIMEOUT_S)
        if self._stop_sent_at is None:
            if not any(hb.get("phase") in ("train", "saving") for hb in beats):
                return Failure(FailureKind.STOPPED, f"{name} before training began: nothing new to save")
            atomic_write(
                self.rd.meta / STOP_FILE,
                json.dumps({"attempt": attempt, "signal": name, "time": time.time(), "timeout_s": timeout}),
            )
            self._stop_sent_at = now
            self.events(
                "stop_requested",
                f"{name}: every rank saves at the next step boundary, then stops (at most {timeout:g}s; "
                "a second signal stops at once)",
                signal=name,
                timeout_s=timeout,
            )
            return None
        if now - self._stop_sent_at > timeout:
            self.interrupted = self.stop_requested
            return Failure(
                FailureKind.INTERRUPTED,
                f"the graceful stop did not finish within stop_timeout_s={timeout:g}s: tearing down",
                step=self._step(attempt),
            )
        return None

    def _exclude_stragglers(self) -> None:
        """resilience.exclude_stragglers: a host named a straggler is left out (a graceful stop, then a shrink onto
        the other hosts) when cluster.min_nodes allows it."""
        if not self.res.exclude_stragglers or self._exclude or self.stop_requested:
            return
        report = self.observer.straggler_report
        if report is None or not report.stragglers:
            return
        hosts = [h for h, _ in self.inputs.hosts]
        out = hosts_to_exclude(report, hosts, self.min_nodes)
        if out:
            self._exclude = out
            self.events(
                "exclude_stragglers",
                f"leaving out straggler(s) {', '.join(out)}: saving the step in flight, then continuing on "
                f"{', '.join(h for h in hosts if h not in out)}",
                hosts=out,
            )

    def _dead_ranks(self, attempt: int) -> list[int]:

        dead = []
        for r in self.rd.records("pids", attempt):
            if is_local(r["host"]):
                if not is_alive(int(r["pid"]), r.get("start_time")):
                    dead.append(int(r["rank"]))
        return dead


UNWATCHED = (
    "the script has built no HF Trainer and does not call ftkit.hf.step(): ftkit cannot see its steps, so it cannot "
    "detect a hang or resume it from a checkpoint; it keeps running to its end (a loop of your own can report its "
    "steps, checkpoints and resume point through ftkit.hf.step / checkpoint / resume_checkpoint)"
)
UNWATCHED_END = "it built no HF Trainer and called no ftkit.hf.step(), so ftkit could not watch it or commit a model"


def not_resumed(beats: list[Heartbeat], resumed_from: tuple[int | None, str] | None) -> str | None:
    """One line when a rank of an attempt ftkit resumed from checkpoint K began training before step K (its
    heartbeat's ``started_at_step``, or a step it trained): it retrains from scratch and would pass for a resume."""
    if resumed_from is None:
        return None
    k, name = resumed_from
    if k is None:
        return None
    for hb in beats:
        started, step = hb.get("started_at_step"), hb.get("step")
        began = started if isinstance(started, int) else None
        if began is None and hb.get("phase") == "train" and isinstance(step, int) and step < k:
            began = step - 1
        if began is not None and began < k:
            return (
                f"the script trained step {began + 1} after ftkit resumed it from {name}: it does not pass "
                "ftkit.hf.resume_checkpoint() to trainer.train() (or resets the Trainer's state); relaunching would "
                "train from scratch again, so ftkit stops here"
            )
    return None


def unwatchable(beats: list[Heartbeat], world_size: int) -> bool:
    """Every rank runs under the import hook, and none built an HF Trainer or called ftkit.hf.step(): a script
    ftkit can see start but never step (a plain PyTorch or Accelerate loop). Such a rank is healthy, not hung."""
    return len(beats) >= world_size and all(
        hb.get("hooked") and not hb.get("trainer") and not hb.get("loop") and hb.get("step") is None for hb in beats
    )
