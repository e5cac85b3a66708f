"""The monitor step of the supervisor's script: watch one attempt until it succeeds or first fails.

Every ``poll_s`` :meth:`Monitor.watch` reads the attempt's heartbeats once and, in this order: the stop control's
graceful stop (:mod:`ftkit.supervise.stopping`), what :mod:`ftkit.supervise.observe` reads (metrics, resume
fidelity, stragglers), a script that trained from an earlier step than ftkit resumed it from, the ranks' error
records, the engine processes' exits (a rank that died without a record on a full device says so), and the
heartbeats' timing (:class:`ftkit.supervise.decide.Progress`). What it finds is one :class:`Failure`, or None when
every process ended with 0.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit.checkpoint.layout import read_commit
from ftkit.cluster.hosts import is_local
from ftkit.cluster.procs import exit_meaning, is_alive
from ftkit.errors import ExitCode
from ftkit.rundir.failures import BY_NAME, DS_SHM_BYTES_PER_RANK, SCRIPT_EXIT, free_bytes
from ftkit.rundir.layout import NEARLY_FULL, RunDir
from ftkit.supervise.cause import Cause, attempt_cause
from ftkit.supervise.decide import FailureKind, Progress, Situation
from ftkit.supervise.events import is_no_space
from ftkit.supervise.observe import root_cause

if TYPE_CHECKING:
    from ftkit.command.engines import LaunchInputs
    from ftkit.rundir.records import ErrorRecord, Heartbeat
    from ftkit.rundir.sections import ResilienceSection
    from ftkit.supervise.attempt import Spawned
    from ftkit.supervise.events import Events
    from ftkit.supervise.observe import Observer
    from ftkit.supervise.stopping import StopControl
    from ftkit.supervise.tier_resume import LocalTier

UNWATCHED = (
    "the script has built no HF Trainer and does not call ftkit.hf.step(): ftkit cannot see its steps, so it cannot "
    "detect a hang or resume it from a checkpoint; it keeps running to its end (a loop of your own can report its "
    "steps, checkpoints and resume point through ftkit.hf.step / checkpoint / resume_checkpoint)"
)
UNWATCHED_END = "it built no HF Trainer and called no ftkit.hf.step(), so ftkit could not watch it or commit a model"


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

    def say(self, echo: Callable[[str], None]) -> None:
        """What the ranks reported, and the script's traceback, for the user."""
        for line in self.lines:
            echo(f"ftkit: error: {line}")
        if self.traceback:
            echo("  the script's traceback (last lines):")
            for line in self.traceback:
                echo(f"    {line[:300]}")

    def situation(
        self, *, newest_commit: int | None, signum: int | None, lost: list[str], nodes: int, min_nodes: int | None
    ) -> Situation:
        """What :func:`ftkit.supervise.decide.decide` is given: this failure and its cause, with what the supervisor
        knows after the teardown (the newest commit, the signal, the hosts lost, the job's and the least nodes)."""
        s = Situation(
            self.kind,
            detail=self.message,
            step=self.step,
            newest_commit=newest_commit,
            signum=signum,
            lost_hosts=tuple(lost),
            nodes=nodes,
            min_nodes=min_nodes,
        )
        if self.cause is None:
            return s
        c = self.cause
        return replace(
            s,
            cause=c.cls.name,
            restartable=c.cls.restartable,
            signature=c.signature,
            cause_line=c.describe(),
            hint=c.cls.hint,
        )


class Monitor:
    """Watches the attempts of one launch. ``beats`` (the newest poll's heartbeats) and ``unwatched`` (the script
    built no Trainer and calls no ``ftkit.hf.step()``: it is not restarted) describe the attempt watched last."""

    def __init__(
        self,
        rd: RunDir,
        events: Events,
        observer: Observer,
        stop: StopControl,
        tier: LocalTier,
        resilience: ResilienceSection,
        poll_s: float,
    ):
        self.rd, self.events, self.observer, self.stop, self.tier = rd, events, observer, stop, tier
        self.res = resilience
        self.poll_s = poll_s
        self.beats: list[Heartbeat] = []
        self.unwatched = False
        self.resumed_from: tuple[int | None, str] | None = None  # (step, checkpoint name) the attempt resumed from

    def start(self, resume: str | None, step: int | None) -> None:
        """A new attempt, resuming from ``resume`` at ``step`` (None: from scratch)."""
        self.unwatched = False
        self.resumed_from = (step, Path(resume).name) if resume else None

    def watch(
        self, procs: list[Spawned], attempt: int, started: float, inputs: LaunchInputs, world_size: int
    ) -> Failure | None:
        """Until success (None) or the first failure. Heartbeat changes are timed by this clock (no skew)."""
        progress = Progress(started, float(self.res.startup_timeout_s), float(self.res.hang_timeout_s))
        while True:
            if self.stop.interrupted:
                return Failure(FailureKind.INTERRUPTED, f"interrupted by {signal.Signals(self.stop.interrupted).name}")
            if self.events.write_error is not None and is_no_space(self.events.write_error):
                e = self.events.write_error
                return Failure(
                    FailureKind.NO_SPACE, "ftkit ran out of disk space", lines=[f"no space left on {e.filename}"]
                )
            now = time.monotonic()
            beats = [hb for hb in self.rd.heartbeats() if hb.get("attempt") == attempt]
            self.beats = beats
            if self.stop.requested or self.stop.exclude:  # decided on this poll's heartbeats, never an older poll's
                stopping = self.stop.poll(attempt, beats)
                if stopping is not None:
                    return stopping
            mismatch = self.observer.poll(attempt, beats, now, progress.phases)
            if mismatch:
                return Failure(FailureKind.RESUME_MISMATCH, mismatch, step=newest_step(self.rd, attempt))
            earlier = not_resumed(beats, self.resumed_from)
            if earlier:
                return Failure(FailureKind.NOT_RESUMED, earlier, step=newest_step(self.rd, attempt))
            self.stop.exclude_stragglers(self.observer.straggler_report, [h for h, _ in inputs.hosts])
            codes = [p.proc.poll() for p in procs]
            errors = self.rd.records("errors", attempt)
            if errors:
                return self._error_failure(errors, attempt)
            bad = [(p, c) for p, c in zip(procs, codes, strict=True) if c not in (None, 0)]
            if bad and self.stop.sent_at is not None:
                return Failure(
                    FailureKind.INTERRUPTED,
                    f"a rank ended during the graceful stop ({exit_meaning(bad[0][1])}): the stop's save may be torn",
                    step=newest_step(self.rd, attempt),
                )
            if bad:
                p, c = bad[0]
                time.sleep(0.3)  # let a rank finish writing its error record before we look again
                if self.rd.records("errors", attempt):
                    continue
                full = self._full_device(inputs)  # a rank that could not even write its error record
                if full is not None:
                    return Failure(
                        FailureKind.NO_SPACE,
                        f"node {p.node_rank} ({p.host}) engine ended: {exit_meaning(c)}; {full[0]} is full",
                        step=newest_step(self.rd, attempt),
                        exit_code=c,
                        lines=[f"no space left on {full[0]}{full[1]}"],
                    )
                return Failure(
                    FailureKind.EXIT,
                    f"node {p.node_rank} ({p.host}) engine ended: {exit_meaning(c)}" + root_cause(p.log),
                    step=newest_step(self.rd, attempt),
                    exit_code=c,
                    cause=attempt_cause(self.rd, attempt, c, self.tier.own_dirs()),
                )
            if all(c == 0 for c in codes):
                if self.stop.sent_at is not None and not final_committed(self.rd, attempt):
                    return Failure(
                        FailureKind.STOPPED, "every rank saved and stopped", step=newest_step(self.rd, attempt)
                    )
                return None
            progress.observe(beats, now)
            found = progress.failure(now, newest_step(self.rd, attempt))
            if found and found[0] is FailureKind.STARTUP and unwatchable(beats, world_size):
                self.unwatched = True  # healthy, just invisible: let it run to its end, do not restart it
                progress.startup_timeout_s = float("inf")
                self.events("unwatched", UNWATCHED)
                found = None
            if found:
                return Failure(found[0], found[1], step=newest_step(self.rd, attempt))
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
                step=newest_step(self.rd, attempt),
                exit_code=ExitCode.SCRIPT_FAILED,
                cause=cause,
            ).with_traceback(tb)
        return Failure(FailureKind.USER_ERROR, "a rank reported an error a restart cannot fix", lines=lines)

    def _full_device(self, inputs: LaunchInputs) -> tuple[str, str] | None:
        """(a full place this machine's ranks write to, why it matters), checked when ranks die without a record:
        the run directory, this machine's local checkpoint tier, and on the cpu accelerator /dev/shm, where
        DeepSpeed's collectives map 66 MiB per rank (a tmpfs too small for them kills every rank with SIGBUS or
        SIGSEGV at its first collective, and every restart would do the same)."""
        places = [(str(self.rd.path), "")]
        places += [(d, "") for d in self.tier.local_dirs([h for h, _ in inputs.hosts])]
        if inputs.accelerator == "cpu" and Path("/dev/shm").is_dir():
            per_rank = DS_SHM_BYTES_PER_RANK >> 20
            places.append(("/dev/shm", f": DeepSpeed's CPU collectives map {per_rank} MiB per rank there"))
        for path, why in places:
            if free_bytes(path) < NEARLY_FULL:
                return path, why
        return None


def newest_step(rd: RunDir, attempt: int) -> int | None:
    """The newest step any rank of the attempt reported in its heartbeat."""
    found = [hb.get("step") for hb in rd.heartbeats() if hb.get("attempt") == attempt]
    steps = [s for s in found if isinstance(s, int)]
    return max(steps) if steps else None


def final_committed(rd: RunDir, attempt: int) -> bool:
    """final/ committed by *this* attempt: a relaunch of a finished run finds the old record still there."""
    try:
        rec = read_commit(rd.final)
    except (OSError, ValueError):
        return False
    if not rec:
        return False
    return (rec.get("extra") or {}).get("attempt") == attempt


def dead_ranks(rd: RunDir, attempt: int) -> list[int]:
    """The ranks of this machine whose recorded process is gone."""
    dead = []
    for r in rd.records("pids", attempt):
        if is_local(r["host"]):
            if not is_alive(int(r["pid"]), r.get("start_time")):
                dead.append(int(r["rank"]))
    return dead


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
