"""What the supervisor reads while an attempt runs, besides exits and heartbeat timing
(:mod:`ftkit.supervise.supervisor`).

One :class:`Observer` per ``ftkit launch``; :meth:`Observer.poll` is called every supervisor poll with the
heartbeats the poll read anyway, and says what it saw:

* **metrics** (rank 0's ``metrics.jsonl``, new lines only): the progress line (:mod:`ftkit.supervise.progress`:
step/total,   loss, samples/s, tokens/s, ETA; in place on a terminal, periodic plain lines in a log), one line per
committed   checkpoint, and for a resumed attempt the comparison of recomputed steps with the logged ones
  (:mod:`ftkit.supervise.fidelity`); a mismatch beyond 10x the tolerance is returned so the supervisor stops;
* **the recipe's overrides of a wrapped script's TrainingArguments** (``attempts/N/args_changes.json``, written
  by rank 0 through :mod:`ftkit.hf`), listed once per name as ``name: from -> to`` and put in ``events.jsonl``;
* **stragglers** (:mod:`ftkit.supervise.stragglers`): a host whose ranks compute consistently slower, named once per
attempt   with numbers; the latest report serves ``resilience.exclude_stragglers``;
* **a stale JIT build lock** (:mod:`ftkit.cluster.buildlocks`): a rank stuck in its loading phase for a minute while a
  torch extension build lock nobody holds exists: named with the fix, once, instead of a silent wait for
  ``startup_timeout_s``.

After a failure :func:`log_tail` shows the failing rank's last lines and :func:`root_cause` maps torchrun's summary
back to the rank that failed first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit.cluster.buildlocks import loading_hint
from ftkit.cluster.procs import exit_meaning
from ftkit.rundir.layout import RunDir
from ftkit.rundir.records import JSON, EventSink, MetricsRecord, StragglerRecord
from ftkit.supervise.fidelity import FidelityCheck
from ftkit.supervise.progress import MetricsTail, Progress
from ftkit.supervise.stragglers import StragglerReport, StragglerWatch, hosts_by_rank

if TYPE_CHECKING:
    from ftkit.rundir.records import Heartbeat


class Observer:
    def __init__(
        self,
        rd: RunDir,
        events: EventSink,
        *,
        max_steps: int | None,
        global_batch: int,
        progress: Progress | None = None,
    ):
        self.rd = rd
        self.events = events
        self.progress = progress or Progress(total_steps=max_steps, global_batch=global_batch)
        self.metrics = MetricsTail(rd.metrics, from_end=True)
        self.fidelity: FidelityCheck | None = None
        self.stragglers = StragglerWatch()
        self._attempt: int | None = None
        self._hosts: dict[int, str] = {}
        self._changes_listed: set[JSON] = set()
        self._changes_seen: set[tuple[int, int, int]] = set()
        self._hint_given = False

    def echo(self, text: str) -> None:
        """A line of its own, above the progress line."""
        self.progress.message(text)

    def start_attempt(self, attempt: int, fidelity: FidelityCheck | None) -> None:
        self._attempt = attempt
        self.fidelity = fidelity
        self._hosts = {}

    def poll(
        self, attempt: int, heartbeats: list[Heartbeat], now: float, phases: Mapping[int, tuple[str, float]]
    ) -> str | None:
        """One look; returns why the run must stop (recomputed steps disagree with the logged ones), or None."""
        mismatch = self._metrics(attempt)
        self._args_changes(attempt)
        if not self._hosts:
            self._hosts = hosts_by_rank(self.rd, attempt)
        for line in self.stragglers.check(heartbeats, self._hosts or None, attempt):
            self.events("straggler", line.removeprefix("ftkit: "), report=self._straggler_dict())
        if not self._hint_given:
            hint = loading_hint(heartbeats, now, since=phases)
            if hint:
                self._hint_given = True
                self.events("build_lock", hint)
        return mismatch

    def finish(self) -> None:
        self._metrics(self._attempt)
        self.progress.finish()

    @property
    def straggler_report(self) -> StragglerReport | None:
        return self.stragglers.report

    def _straggler_dict(self) -> StragglerRecord | None:
        r = self.stragglers.report
        return r.as_dict() if r is not None else None

    # ------------------------------------------------------------------------------------------------ metrics

    def _metrics(self, attempt: int | None) -> str | None:
        stop = None
        for m in self.metrics.poll():
            if m.get("attempt") != attempt:
                continue
            if m.get("event") == "commit":
                if m.get("tier") != "local":  # local-tier saves (every few steps) are said when they become durable
                    self.echo(f"  committed checkpoint-{m.get('step')} ({m.get('commit_s', 0):.2f}s)")
                continue
            if m.get("event") == "durable":
                if m.get("published"):
                    self.echo(
                        f"  committed checkpoint-{m.get('step')} (local tier, copied in the background in "
                        f"{m.get('copy_s', 0):.2f}s)"
                    )
                continue
            self.progress.update(m)
            if isinstance(m.get("loss"), (int, float)):
                stop = self._check_fidelity(m) or stop
        return stop

    def _check_fidelity(self, m: MetricsRecord) -> str | None:
        if self.fidelity is None:
            return None
        tol = self.fidelity.tolerance
        stop = None
        for mm in self.fidelity.observe(m):
            self.events(
                "resume_mismatch",
                "warning: " + mm.message(tol),
                step=mm.step,
                metric=mm.what,
                logged=mm.logged,
                now=mm.now,
                relative=mm.rel,
                stop=mm.stop,
            )
            if mm.stop and stop is None:
                stop = mm.message(tol)
        return stop

    # ------------------------------------------------------------------------------------------------ wrapped scripts

    def _args_changes(self, attempt: int) -> None:
        """A wrapped script's TrainingArguments that the recipe overrode (ftkit.hf), each name listed once per run."""
        path = self.rd.attempt_dir(attempt) / "args_changes.json"
        try:
            st = path.stat()
            key = (attempt, st.st_size, st.st_mtime_ns)
            if key in self._changes_seen:  # rank 0 adds to it later too (train(resume_from_checkpoint=...))
                return
            rows = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        self._changes_seen.add(key)
        if not isinstance(rows, list):
            return
        new = [r for r in rows if isinstance(r, dict) and r.get("name") not in self._changes_listed]
        self._changes_listed.update(r.get("name") for r in new)
        if new:
            self.events(
                "args_changed",
                "the recipe overrides the script's TrainingArguments:\n"
                + "\n".join(f"    {r.get('name')}: {r.get('from')!r} -> {r.get('to')!r}" for r in new),
                changes=new,
            )


# ------------------------------------------------------------------------------------------------ after a failure


def log_tail(rd: RunDir, attempt: int, echo: Callable[[str], None], lines: int = 6) -> None:
    """Show the error of a rank that failed by itself (survivors' 'connection reset by peer' is only an echo);
    when no rank shows one, the engine's own log: a launcher that failed before any rank started (a bad
    argument, a missing module) says why only there."""
    shown = False
    log_dir = rd.log_dir(attempt)
    rank_logs = sorted(log_dir.glob("rank-*.log"))
    for log in rank_logs + ([] if rank_logs else sorted(log_dir.glob("launcher-node*.log"))):
        try:
            tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-lines:]
        except OSError:
            continue
        text = "\n".join(tail)
        if "Traceback" in text or "Error" in text or "error" in text:
            if any(s in text for s in ("by peer", "Connection closed", "Socket Timeout", "NCCL communicator")):
                continue
            echo(f"  last lines of {log}:")
            for x in tail:
                echo(f"    {x[:200]}")
            shown = True
    if not shown and not rank_logs:
        echo("  no rank started: see the engine's log")
    echo(f"  logs of this attempt: {log_dir}")


_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", re.S)


def root_cause(log: Path) -> str:
    """torchrun (and accelerate, which runs it) exits 1 whatever happened; its summary names the rank that failed
    first and that rank's own exit code (-9: SIGKILL). Map it back so the event says what really happened."""
    try:
        text = log.read_text(errors="replace")[-20000:]
    except OSError:
        return ""
    tail = text.split("Root Cause (first observed failure):")[-1] if "Root Cause" in text else ""
    m = _TORCHRUN_FAILURE.search(tail)
    if not m:
        return ""
    return f"; root cause: rank {m.group(1)} {exit_meaning(int(m.group(2)))}"


def heartbeats_of(hbs: Iterable[Heartbeat], attempt: int) -> list[Heartbeat]:
    return [hb for hb in hbs if hb.get("attempt") == attempt]
