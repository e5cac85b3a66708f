"""The supervisor's decisions as pure functions: no processes, no files, no clock of their own.

* :class:`Progress` turns heartbeats seen at times ``now`` (the supervisor's own monotonic clock, so skew between
  hosts and attribute caching on shared storage cannot fake progress) into "still fine", a startup timeout or a
  hang;
* :func:`decide` maps a failure (its :class:`FailureKind`) and the job's history (:class:`RestartPolicy`) to one
  :class:`Decision`: restart, shrink onto the remaining hosts, or stop with a documented exit code.

``tests/supervise/test_supervise.py`` covers every branch with a fake clock; :mod:`ftkit.supervise.supervisor` only
carries them out.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from ftkit.errors import ExitCode
from ftkit.rundir.records import Heartbeat

NO_PROGRESS_LIMIT = 2  # the same failure point this many times in a row, with no new commit: give up


class FailureKind(Enum):
    EXIT = "exit"  # an engine process ended with a non-zero code
    HANG = "hang"  # no progress for resilience.hang_timeout_s
    STARTUP = "startup"  # no first step within resilience.startup_timeout_s
    USER_ERROR = "user_error"  # a rank reported an error a restart cannot fix (bad data, bad model directory)
    NO_SPACE = "no_space"  # a write failed with ENOSPC: restarting would fail the same way
    INTERRUPTED = "interrupted"  # SIGINT/SIGTERM/SIGHUP to ftkit launch
    RESUME_MISMATCH = "resume_mismatch"  # recomputed steps disagree with the logged run beyond 10x the tolerance
    STOPPED = "stopped"  # a graceful stop finished: every rank saved the same step and it is committed
    NOT_RESUMED = "not_resumed"  # resumed from checkpoint K, the script trained from an earlier step anyway
    SCRIPT_ERROR = "script_error"  # a script failure that repeats: before its first step, or a save of nothing


class Action(Enum):
    RESTART = "restart"
    SHRINK = "shrink"  # restart on the hosts that are left (cluster.min_nodes allows it)
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    exit_code: int = ExitCode.OK
    delay_s: float = 0.0

    @property
    def restart(self) -> bool:
        return self.action is not Action.STOP


@dataclass(frozen=True)
class Situation:
    """What the supervisor knows after a failure and the teardown that followed it."""

    kind: FailureKind
    step: int | None = None  # the newest step any rank reported
    newest_commit: int | None = None  # the newest committed checkpoint's step
    signum: int | None = None  # for INTERRUPTED
    lost_hosts: tuple[str, ...] = ()  # hosts the probe after teardown could not reach
    nodes: int = 1  # nodes of the attempt that failed
    min_nodes: int | None = None  # cluster.min_nodes (None: every node must stay)
    detail: str = ""  # the failure's own one line, where the decision repeats it (NOT_RESUMED)
    # why it failed (ftkit.rundir.failures): whether a restart can change it, and what makes a repeat "the same"
    cause: str = ""  # the failure class's name
    restartable: bool = True
    signature: str | None = None
    cause_line: str = ""  # who failed and how, with the log: "rank 0 on node0: OSError: ... (log: ...)"
    hint: str = ""


@dataclass
class RestartPolicy:
    """Restart bookkeeping: one budget for the whole job, one restart per incident, backoff with jitter, and
    giving up when failures repeat at the same step without a new committed checkpoint."""

    max_restarts: int
    backoff_s: float
    backoff_max_s: float
    rng: random.Random = field(default_factory=random.Random)
    used: int = 0
    no_progress: int = 0
    last_failure: tuple[int | None, int | None] | None = None  # (step at failure, newest commit then)
    last_startup: str | None = None  # the signature of the previous attempt's failure before its first step

    def backoff(self) -> float:
        """Exponential backoff with jitter: base x 2^k, capped, then scaled by a random 0.5-1.0."""
        base = min(self.backoff_max_s, self.backoff_s * (2**self.used))
        return base * self.rng.uniform(0.5, 1.0)

    def on_failure(self, step: int | None, newest_commit: int | None, action: Action = Action.RESTART) -> Decision:
        point = (step, newest_commit)
        self.no_progress = self.no_progress + 1 if point == self.last_failure else 0
        self.last_failure = point
        if self.no_progress >= NO_PROGRESS_LIMIT:
            return Decision(
                Action.STOP,
                f"failed {self.no_progress + 1} times in a row {at_step(step)} with no new committed checkpoint: "
                f"giving up (restarts used {self.used} of {self.max_restarts})",
                ExitCode.BUDGET_EXHAUSTED,
            )
        if self.used >= self.max_restarts:
            return Decision(
                Action.STOP,
                f"restart budget exhausted ({self.used} of {self.max_restarts} used)",
                ExitCode.BUDGET_EXHAUSTED,
            )
        delay = self.backoff()
        self.used += 1
        return Decision(action, f"restart {self.used} of {self.max_restarts} in {delay:.1f}s", delay_s=delay)


def at_step(step: int | None) -> str:
    """``at step N``, or ``before the first step`` when no rank reported one (never "at step None")."""
    return "before the first step" if step is None else f"at step {step}"


def interrupted_code(signum: int | None) -> int:
    """130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP (a closed terminal is handled like SIGTERM)."""
    return 128 + int(signum) if signum else ExitCode.SIGTERM


def decide(s: Situation, policy: RestartPolicy) -> Decision:
    """Failure kind x history -> restart, shrink or stop (with the exit code). Mutates ``policy`` (it counts)."""
    if s.kind is FailureKind.INTERRUPTED:
        code = interrupted_code(s.signum)
        name = signal.Signals(s.signum).name if s.signum else "a signal"
        return Decision(Action.STOP, f"interrupted by {name}: run torn down, exit {code}", code)
    if s.kind is FailureKind.STOPPED:
        name = signal.Signals(s.signum).name if s.signum else "request"
        if s.newest_commit is not None:
            where = f"checkpoint committed at step {s.newest_commit}; ftkit launch resumes from it"
        else:
            where = "nothing was saved (no step had finished); ftkit launch starts over"
        return Decision(Action.STOP, f"stopped on request ({name}): {where}", ExitCode.STOPPED)
    if s.kind is FailureKind.SCRIPT_ERROR:
        if s.cause_line:
            return Decision(
                Action.STOP,
                f"not restarting: {s.cause_line}: a restart cannot change it ({s.cause})"
                + (f" [{s.hint}]" if s.hint else ""),
                ExitCode.SCRIPT_FAILED,
            )
        return Decision(
            Action.STOP,
            "not restarting: the training script's failure above would repeat on every attempt",
            ExitCode.SCRIPT_FAILED,
        )
    if s.kind is FailureKind.USER_ERROR:
        return Decision(Action.STOP, "not restarting: fix the error above and launch again", ExitCode.USAGE)
    if s.kind is FailureKind.NO_SPACE:
        return Decision(
            Action.STOP,
            "not restarting: the disk is full; free space (committed checkpoints are intact) and launch again",
            ExitCode.NO_SPACE,
        )
    if s.kind is FailureKind.NOT_RESUMED:
        return Decision(Action.STOP, f"not restarting: {s.detail}", ExitCode.RESUME_MISMATCH)
    if s.kind in (FailureKind.EXIT, FailureKind.HANG, FailureKind.STARTUP) and s.step is None and not s.lost_hosts:
        repeated = s.signature is not None and s.signature == policy.last_startup
        policy.last_startup = s.signature
        if not s.restartable or repeated:
            why = (
                f"a restart cannot change it ({s.cause})"
                if not s.restartable
                else "the previous attempt failed the same way before its first step"
            )
            return Decision(
                Action.STOP,
                f"not restarting: {s.cause_line or s.detail}: {why}" + (f" [{s.hint}]" if s.hint else ""),
                ExitCode.SCRIPT_FAILED,
            )
    else:
        policy.last_startup = None
    if s.kind is FailureKind.RESUME_MISMATCH:
        return Decision(
            Action.STOP,
            "resumed state disagrees with the logged run: not restarting from a checkpoint that does not "
            "reproduce its own history (see the resume_mismatch events)",
            ExitCode.RESUME_MISMATCH,
        )
    if s.lost_hosts:
        remaining = s.nodes - len(set(s.lost_hosts))
        need = s.min_nodes if s.min_nodes is not None else s.nodes
        if remaining < max(1, need):
            return Decision(
                Action.STOP,
                f"{remaining} of {s.nodes} node(s) left and cluster.min_nodes is "
                f"{s.min_nodes if s.min_nodes is not None else 'null (all nodes)'}: stopping; bring the host(s) back "
                "and launch again (the run resumes from its newest committed checkpoint), or allow fewer nodes with "
                "cluster.min_nodes",
                ExitCode.HOST_LOST,
            )
        return policy.on_failure(s.step, s.newest_commit, Action.SHRINK)
    return policy.on_failure(s.step, s.newest_commit)


@dataclass
class Progress:
    """Startup and hang detection from heartbeats, timed on the caller's clock.

    ``observe`` is called every poll with the heartbeats of the current attempt; a heartbeat whose (phase, step,
    time) changed counts as life, and a changed step in the ``train`` phase as progress.
    """

    started: float
    startup_timeout_s: float
    hang_timeout_s: float
    seen: dict[int, tuple[str | None, int | None, float | None]] = field(default_factory=dict)  # (phase, step, time)
    first_step_seen: bool = False
    last_progress: float = 0.0
    phases: dict[int, tuple[str, float]] = field(default_factory=dict)  # rank -> (phase, since when)

    def observe(self, heartbeats: Iterable[Heartbeat], now: float) -> None:
        for hb in heartbeats:
            rank = hb.get("rank")
            if not isinstance(rank, int):
                continue
            key = (hb.get("phase"), hb.get("step"), hb.get("time"))
            if self.seen.get(rank) == key:
                continue
            self.seen[rank] = key
            if self.phases.get(rank, (None,))[0] != hb.get("phase"):
                self.phases[rank] = (str(hb.get("phase")), now)
            if hb.get("phase") == "train" and hb.get("step") is not None:
                self.first_step_seen = True
                self.last_progress = now

    def failure(self, now: float, step: int | None) -> tuple[FailureKind, str] | None:
        if not self.first_step_seen and now - self.started > self.startup_timeout_s:
            return (
                FailureKind.STARTUP,
                f"no training step within startup_timeout_s={self.startup_timeout_s:g}s "
                f"(ranks heard from: {sorted(self.seen) or 'none'})",
            )
        if self.first_step_seen and now - self.last_progress > self.hang_timeout_s:
            return (
                FailureKind.HANG,
                f"no progress for {now - self.last_progress:.0f}s (hang_timeout_s={self.hang_timeout_s:g}) "
                f"{at_step(step)}",
            )
        return None
