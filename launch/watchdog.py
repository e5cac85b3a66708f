"""Ranks watch their supervisor, as the supervisor watches them (docs/design.md, Run directory).

A rank whose ``ftkit launch`` is gone (SIGKILLed, its terminal or ssh session closed, its head node lost) must not
train on unwatched, holding GPUs with no hang detection and no restarts. A daemon thread in every rank looks every
:data:`POLL_S` seconds at the run's owner record and the supervisor heartbeat (``ftkit/owner.json``,
``ftkit/supervisor.json``, see :mod:`ftkit.run.ownership`):

* the supervisor counts as *seen* when its pid (with its start time) is alive on this host, or when the heartbeat's
  content changed since the last look (timed on this rank's own monotonic clock, so clock skew between hosts and
  attribute caching of a shared file system only delay detection, never fake it);
* when it has not been seen for ``resilience.orphan_timeout_s`` (default 60), or the owner record names another
  supervisor (a ``--takeover``), the rank removes the run's /dev/shm buffers on this host and SIGTERMs itself.
  Its engine agent (torchrun, DeepSpeed's launcher) then stops the node's other ranks, which also notice on their own.

A rank that ends on its own while its supervisor is gone (it finished the run first) also removes the buffers
(:mod:`ftkit.hf`), and rank 0 records the outcome in ``events.jsonl`` either way, so ``ftkit status`` tells.

Bound: a rank stops at most ``orphan_timeout_s + POLL_S`` seconds after its supervisor died (plus the time the
engine's agent takes to stop its peers, about a second); one stuck where SIGTERM cannot reach it is SIGKILLed
:data:`ESCALATE_S` later. Started by :mod:`ftkit.hf`, it first asks for the same
graceful stop the supervisor would (every rank saves the same step, committed), waiting up to
``resilience.stop_timeout_s`` for it: a rank whose supervisor vanished loses no completed step.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import threading
import time
from pathlib import Path

from ftkit.cluster.procs import SHM_DIR, SHM_PREFIX, is_alive
from ftkit.rundir.layout import RunDir
from ftkit.rundir.owner import HEARTBEAT_S, Owner

POLL_S = 2.0
# After its SIGTERM the rank has this long to unwind (the supervisor's own teardown grace); then SIGKILL. A rank still
# starting up turns SIGTERM into an exception (launch/train.py), which Python raises only when the main thread comes
# back to the interpreter: one blocked in C (a collective spinning on a peer that is gone, an op build's wait) never
# does, and such ranks were seen alive 10 minutes after their supervisor died.
ESCALATE_S = 10.0


class SupervisorWatchdog:
    def __init__(
        self,
        rd: RunDir,
        timeout_s: float,
        log=print,
        clock=time.monotonic,
        *,
        request_stop=None,
        stopped: threading.Event | None = None,
        grace_s: float = 0.0,
        on_stop=None,
        escalate_s: float | None = None,
    ):
        self.rd = rd
        self.timeout_s = float(timeout_s)
        # graceful stop (ftkit.hf): ask this rank to save at the next step boundary, wait up to grace_s for it
        self.request_stop = request_stop
        self.stopped = stopped
        self.grace_s = float(grace_s)
        self.on_stop = on_stop  # why -> None: called once before the rank stops itself (records the outcome)
        self.escalate_s = ESCALATE_S if escalate_s is None else float(escalate_s)
        self.log = log
        self.clock = clock
        self.owner = self._owner()
        self.last_seen = clock()
        self._beat: str | None = None
        self._stop = threading.Event()

    def _owner(self) -> Owner | None:
        try:
            return Owner.from_json(json.loads((self.rd.meta / "owner.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def check(self) -> str | None:
        """One look; returns why the rank must stop, or None."""
        now = self.clock()
        current = self._owner()
        if self.owner is not None and current is not None and current.pid != self.owner.pid:
            return f"another supervisor took the run over ({current.describe()})"
        if self.owner is None and current is not None:
            self.owner = current
        try:
            beat = (self.rd.meta / "supervisor.json").read_text()
        except OSError:
            beat = None
        if beat is not None and beat != self._beat:
            self._beat = beat
            self.last_seen = now
        elif self.owner is not None and self.owner.same_boot and is_alive(self.owner.pid, self.owner.start_time):
            self.last_seen = now  # the supervisor runs on this machine: its pid tells at once
        if now - self.last_seen > self.timeout_s:
            who = self.owner.describe() if self.owner else "unknown"
            return f"supervisor ({who}) not seen for {now - self.last_seen:.0f}s (orphan_timeout_s={self.timeout_s:g})"
        return None

    def start(self) -> bool:
        """Start watching; False (nothing started) when no supervisor owns the run (the entry run by hand)."""
        if self.owner is None:
            return False
        threading.Thread(target=self._run, name="ftkit-supervisor-watchdog", daemon=True).start()
        return True

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            why = self.check()
            if why:
                if self.request_stop is not None and self.stopped is not None:
                    self.log(
                        f"ftkit: {why}: saving at the next step, then stopping ({self.grace_s:g}s at most)", flush=True
                    )
                    self.request_stop()
                    self.stopped.wait(self.grace_s)
                self.log(f"ftkit: {why}: this rank stops itself", flush=True)
                if self.on_stop is not None:
                    self.on_stop(why)
                remove_own_shm()
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(self.escalate_s)  # unwound by now, unless the main thread is stuck outside Python
                self.log(f"ftkit: still running {self.escalate_s:g}s after SIGTERM: SIGKILL", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
                return

    def gone_now(self) -> bool:
        """Whether the supervisor is gone at this moment (for a rank that ends by itself): its pid, on this machine;
        else its heartbeat unchanged for three of its beats. Never on a clock comparison across hosts."""
        if self.owner is None:
            return False
        current = self._owner()
        if current is not None and current.pid != self.owner.pid:
            return True  # taken over: this rank's supervisor is gone
        if self.owner.same_boot:
            return not is_alive(self.owner.pid, self.owner.start_time)
        self.check()
        return self.clock() - self.last_seen > 3 * HEARTBEAT_S


def remove_own_shm() -> None:
    """DeepSpeed's CPU collectives name their buffers after MASTER_ADDR/MASTER_PORT and never remove them."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port):
        return
    pattern = f"{SHM_PREFIX}*_{addr}_{port}_*"
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if fnmatch.fnmatchcase(name, pattern):
            try:
                Path(SHM_DIR, name).unlink()
            except OSError:
                pass
