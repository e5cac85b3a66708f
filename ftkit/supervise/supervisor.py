"""Supervision as a fixed script: resume → spawn → monitor → tear down → decide → (back off, again).

* **resume** (:class:`ftkit.supervise.resume.Resumer`) makes one decision per attempt: the newest checkpoint whose
  commit record verifies, every byte checked; a newer step verified on every node's local tier, or assembled from
  peer copies (:class:`ftkit.supervise.tier_resume.LocalTier`); a universal conversion after a shrink. Rejected
  checkpoints are logged and newer torn ones set aside, so the resumed run can write that step again.
* **spawn** starts the engine's processes (:mod:`ftkit.supervise.attempt`); **monitor**
  (:class:`ftkit.supervise.monitor.Monitor`) watches their exits, every rank's heartbeat, error records, and what
  :mod:`ftkit.supervise.observe` reads (metrics, resume fidelity, stragglers).
* **graceful stop** (:class:`ftkit.supervise.stopping.StopControl`): the first SIGTERM/SIGINT/SIGHUP/SIGUSR1
  (``ftkit stop``, Ctrl-C, Slurm's notice) writes ``ftkit/stop.json``; every rank sees it at the same optimizer
  step (:mod:`ftkit.hf`), saves and commits that step and ends; then teardown, and exit 8. Bounded by
  ``resilience.stop_timeout_s``; past it, or on a second signal, the run is torn down at once (exit 128+N).
* **teardown** stops the whole run on every host by process group and recorded pid (SIGTERM, grace, SIGKILL) and
  removes its /dev/shm buffers. It runs in a ``finally``: no exception between spawn and teardown leaves ranks
  holding the GPUs.
* **decide** is :func:`ftkit.supervise.decide.decide`, a pure function: restart, shrink onto the remaining hosts
  (:meth:`ftkit.supervise.resume.Resumer.shrink`), or stop with a documented exit code.

Every decision is a line in ``events.jsonl``. A full disk ends the run with "no space left on <path>" (exit 12).
At the end, whatever the outcome, the local tier's newest step is copied to the run directory and the tier removed.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ftkit.cluster.procs import exit_meaning
from ftkit.cluster.slurm import transport_for
from ftkit.command.engines import LaunchInputs, build_launch
from ftkit.errors import ExitCode
from ftkit.rundir.layout import RunDir, read_metrics
from ftkit.supervise.attempt import Spawned, spawn, teardown_attempt
from ftkit.supervise.choose import Choice
from ftkit.supervise.decide import Action, Decision, FailureKind, RestartPolicy, Situation, decide
from ftkit.supervise.events import Events, is_no_space
from ftkit.supervise.fidelity import FidelityCheck
from ftkit.supervise.monitor import (
    UNWATCHED_END,
    Failure,
    Monitor,
    dead_ranks,
    final_committed,
    newest_step,
    unwatchable,
)
from ftkit.supervise.observe import Observer, log_tail
from ftkit.supervise.resume import Replanner, Resume, Resumer
from ftkit.supervise.shrink import probe_hosts
from ftkit.supervise.stopping import StopControl
from ftkit.supervise.stragglers import record_step_times
from ftkit.supervise.tier_resume import Agents, LocalTier

if TYPE_CHECKING:
    from ftkit.rundir.sections import ResilienceSection


class Reports(Protocol):
    """What refreshes ``RUN/report.html`` during a launch (:class:`ftkit.report.ReportRefresher`)."""

    def refresh(self) -> None: ...
    def finish(self) -> None: ...


@dataclass(frozen=True)
class SupervisorConfig:
    """Everything a supervisor is given, built in one place by the launch (:func:`ftkit.run.job.supervisor_config`)."""

    rd: RunDir
    inputs: LaunchInputs  # the engine command's inputs (each attempt sets its number and resume; a shrink, hosts)
    base_env: Mapping[str, str]  # the environment the engines' commands are built from
    resilience: ResilienceSection
    stage: int  # the ZeRO stage: a checkpoint of another stage is refused
    world_size: int
    max_steps: int | None  # train.max_steps (None: by epochs)
    ssh_args: list[str]
    global_batch: int | None = None  # for the progress line's samples/s; None: the world size
    logging_steps: int = 1  # train.logging_steps: which recomputed steps the resume fidelity check compares
    min_nodes: int | None = None  # cluster.min_nodes: how far a lost host (or a straggler) may shrink the job
    replanner: Replanner | None = None  # continuing on fewer hosts; None: a lost host ends the run (exit 7)
    echo: Callable[[str], None] = print
    poll_s: float = 0.5
    grace_s: float = 10.0  # teardown: SIGTERM, this long, then SIGKILL
    rng: random.Random | None = None  # the backoff's jitter


class Supervisor:
    def __init__(self, config: SupervisorConfig):
        c, res = config, config.resilience
        self.config, self.rd, self.echo, self.inputs = c, c.rd, c.echo, c.inputs  # inputs: a shrink changes them
        self.check_fidelity = True  # off for an attempt that resumes with changes the user allowed
        self.reports: Reports | None = None  # refreshes RUN/report.html (the launch sets it)
        self.transport = transport_for(c.inputs.engine, c.base_env)
        self.events = Events(c.rd, self._say)
        self.observer = Observer(c.rd, self.events, max_steps=c.max_steps, global_batch=c.global_batch or c.world_size)
        self.policy = RestartPolicy(res.max_restarts, res.backoff_s, res.backoff_max_s, c.rng or random.Random())
        self.tier = LocalTier(c.rd, Agents(c.rd, c.inputs.python, c.ssh_args, self.transport), self.events)
        self.resume = Resumer(
            c.rd,
            self.events,
            self.tier,
            checksums=res.verify_checksums,
            world_size=c.world_size,
            stage=c.stage,
            max_steps=c.max_steps,
            replanner=c.replanner,
        )
        self.stop = StopControl(c.rd, self.events, res.stop_timeout_s, res.exclude_stragglers, c.min_nodes)
        self.watch = Monitor(c.rd, self.events, self.observer, self.stop, self.tier, res, c.poll_s)
        self._lost: list[str] = []  # hosts the next attempt leaves out

    # ------------------------------------------------------------------------------------------------ script

    def run(self, first: Choice | None = None) -> int:
        """The whole job. ``first``: the choice the launcher already made (and checked) for the first attempt."""
        self.stop.install()
        # files holding the ranks' environment (DeepSpeed's env file) live outside the run directory, readable by
        # this user only, for this launch only
        private = tempfile.mkdtemp(prefix="ftkit-env-")
        self.inputs = replace(self.inputs, private_dir=private)
        try:
            return self._run(first)
        except OSError as e:
            if not is_no_space(e):
                raise
            self.echo(f"ftkit: error: no space left on {e.filename or self.rd.path}")
            self.events("gave_up", f"no space left on {e.filename or self.rd.path}", kind=FailureKind.NO_SPACE.value)
            return ExitCode.NO_SPACE
        finally:
            shutil.rmtree(private, ignore_errors=True)
            self.tier.end()
            self.observer.finish()
            self.stop.release()
            if self.reports is not None:
                self.reports.finish()  # the page with the launch's last events; a bounded wait

    def _run(self, first: Choice | None) -> int:
        attempt = self.rd.next_attempt()
        while True:
            self.events.attempt = attempt
            resume = self.resume.next(first, [h for h, _ in self.inputs.hosts])
            first = None
            if resume.exit_code is not None:
                return resume.exit_code
            if self.stop.pending:
                return self._stop_between_attempts()
            failure = self._attempt(attempt, resume)
            if failure is None:
                return self._finished(attempt)
            decision = self._decide(failure, attempt)
            if not decision.restart:
                return self._stop(decision)
            if decision.action is Action.SHRINK:
                plan = self.resume.shrink(list(self.inputs.hosts), self._lost)
                if isinstance(plan, int):
                    return plan
                self.inputs = replace(self.inputs, hosts=tuple(plan.hosts), master_addr=plan.master_addr)
            self.events("restart", decision.reason, restarts=self.policy.used, delay_s=round(decision.delay_s, 2))
            if self.reports is not None:
                self.reports.refresh()  # a detached render: it overlaps the backoff and the next start-up
            deadline = time.monotonic() + decision.delay_s
            while time.monotonic() < deadline and not self.stop.pending:
                time.sleep(0.1)
            if self.stop.pending:
                return self._stop_between_attempts()
            self.resume.restarting()
            attempt += 1

    def _attempt(self, attempt: int, resume: Resume) -> Failure | None:
        """spawn → monitor → tear down (in a ``finally``): how the attempt ended, None when it succeeded."""
        choice = resume.choice
        self.stop.new_attempt()
        self.watch.start(choice.resume, choice.step)
        self._start_fidelity(attempt, choice.step)
        inputs = replace(self.inputs, attempt=attempt, resume=choice.resume)
        cmd = build_launch(inputs, self.config.base_env)
        self.events(
            "launch",
            f"attempt {attempt}: starting {cmd.engine} on {', '.join(h for h, _ in inputs.hosts)}"
            + (f", resuming from {Path(choice.resume).name} ({resume.tier} tier)" if choice.resume else ""),
            engine=cmd.engine,
            resume=choice.resume,
            step=choice.step,
            tier=resume.tier if choice.resume else None,
        )
        procs: list[Spawned] = []
        try:
            spawn(cmd, attempt, self.rd, self.events, procs)
            failure = self.monitor(procs, attempt, time.monotonic())
            if failure is not None and failure.kind is not FailureKind.STOPPED:
                self._record_failure(failure, attempt)
        finally:
            self.teardown(procs, attempt)  # whatever happened above: nothing of the run is left running
        record_step_times(self.rd, attempt, self.events)  # for ftkit report: the next attempt overwrites them
        return failure

    def monitor(self, procs: list[Spawned], attempt: int, started: float) -> Failure | None:
        """Until success (None) or the first failure (:meth:`ftkit.supervise.monitor.Monitor.watch`)."""
        return self.watch.watch(procs, attempt, started, self.inputs, self.resume.world_size)

    def teardown(self, procs: list[Spawned], attempt: int) -> None:
        """Everything of the attempt stops, on every host: by process group and recorded pid, then /dev/shm."""
        c = self.config
        teardown_attempt(
            procs, attempt, self.rd, self.events, grace_s=c.grace_s, ssh_args=c.ssh_args, transport=self.transport
        )

    def _finished(self, attempt: int) -> int:
        if not final_committed(self.rd, attempt) and (self.watch.unwatched or unwatchable(self.watch.beats, 1)):
            self.events("finished", "the script ended (exit 0); " + UNWATCHED_END)
            return ExitCode.OK
        if not final_committed(self.rd, attempt):
            self.events("failed", "the engine exited 0 but no committed final model was written")
            return ExitCode.TRAINING_FAILED
        self.events("finished", f"finished: final model in {self.rd.final}", step=newest_step(self.rd, attempt))
        return ExitCode.OK

    # ------------------------------------------------------------------------------------------------ decide

    def _decide(self, failure: Failure, attempt: int) -> Decision:
        if failure.kind is FailureKind.STOPPED and self.stop.exclude and not self.stop.requested:
            self._lost = list(self.stop.exclude)  # saved and stopped to leave the stragglers out: continue without
            return self.policy.on_failure(failure.step, self.resume.newest_commit(), Action.SHRINK)
        failure.say(self.echo)
        if failure.kind is FailureKind.NO_SPACE:
            self.resume.discard_torn()
        self._lost = []
        crashed = failure.kind in (FailureKind.EXIT, FailureKind.HANG, FailureKind.STARTUP)
        if crashed and not failure.traceback:
            log_tail(self.rd, attempt, self._say)
        if crashed:
            self._lost = probe_hosts(list(self.inputs.hosts), self.config.ssh_args, transport=self.transport)
            if self._lost:
                self.events(
                    "host_lost", f"lost host(s) {', '.join(self._lost)}: not reachable over ssh", hosts=self._lost
                )
        situation = failure.situation(
            newest_commit=self.resume.newest_commit(),
            signum=self.stop.signum,
            lost=self._lost,
            nodes=len(self.inputs.hosts),
            min_nodes=self.config.min_nodes,
        )
        return decide(situation, self.policy)

    def _stop(self, decision: Decision) -> int:
        event = {129: "interrupted", 130: "interrupted", 138: "interrupted", 143: "interrupted"}.get(
            decision.exit_code, "stopped" if decision.exit_code == ExitCode.STOPPED else "gave_up"
        )
        self.events(event, decision.reason, restarts=self.policy.used, exit_code=decision.exit_code)
        return decision.exit_code

    def _stop_between_attempts(self) -> int:
        """A signal while nothing runs: nothing is in flight, so the newest committed checkpoint is where the run
        is (exit 8); a second signal, or none committed, is an interruption as before (128+N)."""
        if self.stop.interrupted or self.resume.newest_commit() is None:
            return self._stop(decide(Situation(FailureKind.INTERRUPTED, signum=self.stop.signum), self.policy))
        newest = self.resume.newest_commit()
        return self._stop(
            decide(Situation(FailureKind.STOPPED, signum=self.stop.requested, newest_commit=newest), self.policy)
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
            dead_ranks=dead_ranks(self.rd, attempt),
        )

    # ------------------------------------------------------------------------------------------------ helpers

    def _start_fidelity(self, attempt: int, resume_step: int | None) -> None:
        fidelity = None
        if resume_step is not None and self.check_fidelity:
            tolerance, every = float(self.config.resilience.resume_tolerance), self.config.logging_steps
            fidelity = FidelityCheck.from_metrics(read_metrics(self.rd.metrics), attempt, tolerance, every, resume_step)
        self.observer.start_attempt(attempt, fidelity)

    def _say(self, text: str) -> None:
        """A line for the user: above the progress line on a terminal (it is rewritten in place there)."""
        if self.observer.progress.tty:
            self.observer.echo(text)
        else:
            self.echo(text)
