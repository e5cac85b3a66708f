"""Stop control: the signals that stop a launch, the stop file that asks the ranks to save and end, and the
stragglers a graceful stop leaves out.

* the first SIGTERM/SIGINT/SIGHUP/SIGUSR1 (``ftkit stop``, Ctrl-C, Slurm's notice) asks for a graceful stop; a
  second one ends the run now (:meth:`StopControl.on_signal`);
* once a stop is asked for, every poll of the monitor calls :meth:`StopControl.poll`: it writes ``ftkit/stop.json``
  once (every rank sees it at the same optimizer step, saves and commits that step and ends: :mod:`ftkit.hf`),
  unless no rank has begun training (then it stops at once: nothing new to save), and bounds the wait by
  ``resilience.stop_timeout_s`` (past it the run is torn down);
* ``resilience.exclude_stragglers``: a host named a straggler is left out, when ``cluster.min_nodes`` allows it, by
  the same graceful stop, then a shrink onto the other hosts (:meth:`StopControl.exclude_stragglers`).

Nothing here starts or stops a process: it decides, writes the stop file and says so in ``events.jsonl``.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from ftkit.rundir.layout import STOP_FILE, RunDir, atomic_write
from ftkit.supervise.decide import FailureKind
from ftkit.supervise.monitor import Failure, newest_step
from ftkit.supervise.stragglers import hosts_to_exclude

if TYPE_CHECKING:
    from signal import Handlers

    from ftkit.rundir.records import EventSink, Heartbeat
    from ftkit.supervise.stragglers import StragglerReport

# A closed terminal (SIGHUP) is handled like SIGTERM; SIGUSR1 is Slurm's advance notice (--signal=B:USR1@T).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
STOP_TIMEOUT_S = 120.0  # resilience.stop_timeout_s when a recipe predates it


class StopControl:
    """Whether, and how, the launch is being stopped. ``requested``: the first signal (save at the next step, then
    stop); ``interrupted``: a signal that ends the run now (the second, or the first past ``timeout_s``);
    ``sent_at``: when the stop file was written for the running attempt; ``exclude``: stragglers a graceful stop is
    leaving out."""

    def __init__(
        self,
        rd: RunDir,
        events: EventSink,
        timeout_s: float | None,
        exclude_stragglers: bool,
        min_nodes: int | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.rd, self.events, self.clock = rd, events, clock
        self.timeout_s = float(timeout_s or STOP_TIMEOUT_S)
        self.exclude_stragglers_on = exclude_stragglers
        self.min_nodes = min_nodes
        self.requested: int | None = None
        self.interrupted: int | None = None
        self.sent_at: float | None = None
        self.exclude: list[str] = []
        self._old: dict[signal.Signals, Callable[[int, FrameType | None], object] | int | Handlers | None] = {}

    @property
    def pending(self) -> bool:
        """A signal came: nothing new is started."""
        return bool(self.interrupted or self.requested)

    @property
    def signum(self) -> int | None:
        return self.interrupted or self.requested

    def install(self) -> None:
        """Handle the stop signals (until :meth:`release`)."""
        self._old = {s: signal.signal(s, self.on_signal) for s in STOP_SIGNALS}

    def release(self) -> None:
        """The handlers from before :meth:`install` again, and no stop file left behind."""
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
        try:
            (self.rd.meta / STOP_FILE).unlink()
        except OSError:
            pass

    def on_signal(self, signum: int, frame: FrameType | None) -> None:  # noqa: ARG002
        if self.requested is None:
            self.requested = signum  # the first: save at the next step boundary, then stop
        else:
            self.interrupted = signum  # the second: tear down now

    def new_attempt(self) -> None:
        self.exclude, self.sent_at = [], None

    def poll(self, attempt: int, beats: list[Heartbeat]) -> Failure | None:
        """Called every poll once a stop is requested: ask the ranks (once), then bound the wait. Only when no rank
        has begun training (still starting or loading: no step can have completed) does it stop at once."""
        name = signal.Signals(self.requested).name if self.requested else "straggler"
        now = self.clock()
        timeout = self.timeout_s
        if self.sent_at is None:
            if not any(hb.get("phase") in ("train", "saving") for hb in beats):
                return Failure(FailureKind.STOPPED, f"{name} before training began: nothing new to save")
            atomic_write(
                self.rd.meta / STOP_FILE,
                json.dumps({"attempt": attempt, "signal": name, "time": time.time(), "timeout_s": timeout}),
            )
            self.sent_at = now
            self.events(
                "stop_requested",
                f"{name}: every rank saves at the next step boundary, then stops (at most {timeout:g}s; "
                "a second signal stops at once)",
                signal=name,
                timeout_s=timeout,
            )
            return None
        if now - self.sent_at > timeout:
            self.interrupted = self.requested
            return Failure(
                FailureKind.INTERRUPTED,
                f"the graceful stop did not finish within stop_timeout_s={timeout:g}s: tearing down",
                step=newest_step(self.rd, attempt),
            )
        return None

    def exclude_stragglers(self, report: StragglerReport | None, hosts: list[str]) -> None:
        """resilience.exclude_stragglers: a host named a straggler is left out (a graceful stop, then a shrink onto
        the other hosts) when cluster.min_nodes allows it."""
        if not self.exclude_stragglers_on or self.exclude or self.requested:
            return
        if report is None or not report.stragglers:
            return
        out = hosts_to_exclude(report, hosts, self.min_nodes)
        if out:
            self.exclude = out
            self.events(
                "exclude_stragglers",
                f"leaving out straggler(s) {', '.join(out)}: saving the step in flight, then continuing on "
                f"{', '.join(h for h in hosts if h not in out)}",
                hosts=out,
            )
