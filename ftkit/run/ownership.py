"""Who owns a run directory: one live supervisor per run (docs/design.md, Run directory).

``ftkit launch`` holds two things for its whole life, both under ``RUN_DIR/ftkit/``:

* ``lock``: an ``fcntl.flock`` on an open file. The kernel drops it when the process dies, however it dies, so on
  a local file system a second launch can never slip in. flock is not reliable on every shared file system (NFS
  versions differ), hence the second guard:
* ``owner.json``: the owner record (host, pid, process start time, boot id, time, argv), created with
  ``link()`` of a complete temp file, which fails if the record exists, on NFS too. A record naming a process that
  still runs, on its host, is a live owner whatever the lock says.

The owner is *dead* only when its pid with that start time is gone on its host (checked locally, or over ssh),
never because a heartbeat is old: clocks and shared file systems lie. A dead owner's record is stale; before it is
replaced, the ranks of its last attempt are looked up in their pid records: if any still runs (the supervisor was
SIGKILLed, its terminal closed), the launch refuses unless ``--takeover`` is given, which tears them down on every
host first.

``supervisor.json`` is the supervisor's heartbeat (rewritten every :data:`HEARTBEAT_S` seconds by a thread). Ranks
watch it (and the owner's pid when it is on their host) and stop by themselves when the supervisor has been gone
for ``resilience.orphan_timeout_s`` (see ``ftkit.launch.watchdog``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit.cluster.hosts import is_local
from ftkit.cluster.procs import (
    Target,
    group_exists,
    is_alive,
    remote_signal,
    remove_shm,
    signal_hosts,
    targets_from_records,
    teardown,
)
from ftkit.errors import ExitCode, Problem, RunBusy, UserError, os_error
from ftkit.rundir.layout import RunDir, atomic_write
from ftkit.rundir.owner import HEARTBEAT_S, Owner, read_owner

if TYPE_CHECKING:
    from ftkit.rundir.records import PidRecord

ORPHAN_POLL_S = 1.0  # how often a relaunch looks whether a dead supervisor's ranks have stopped
WAIT_SLACK_S = 30.0  # on top of the ranks' own bound: their watchdog's poll, the engine agents' teardown


def owner_state(owner: Owner, ssh_args: list[str]) -> str:
    """'alive', 'dead' or 'unknown' (its host cannot be reached to tell)."""
    if owner.same_boot or (owner.named_here and not owner.boot_id):
        return "alive" if is_alive(owner.pid, owner.start_time) else "dead"
    if owner.named_here:
        return "dead"  # this machine's name, recorded before its last reboot
    ok, alive = remote_signal(owner.host, [Target(owner.host, owner.pid, owner.start_time)], "0", ssh_args)
    if not ok:
        return "unknown"
    return "alive" if owner.pid in alive else "dead"


@dataclass
class Leftovers:
    """What of a run's newest attempt still runs: rank pid records (remote ones included: they cannot be checked
    without ssh, and teardown handles them) and the engine launcher groups ftkit spawned on this machine."""

    records: list[PidRecord] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.records or self.groups)

    def stop_themselves(self) -> float | None:
        """Seconds within which every leftover rank stops by itself (its watchdog's orphan_timeout_s +
        stop_timeout_s), or None when one has no watchdog (a rank started otherwise, or by an older ftkit)."""
        bounds = []
        for r in self.records:
            dog = r.get("watchdog")
            if not isinstance(dog, dict):
                return None
            try:
                bounds.append(float(dog.get("orphan_timeout_s", 0)) + float(dog.get("stop_timeout_s", 0)))
            except (TypeError, ValueError):
                return None
        return max(bounds, default=0.0)

    def describe(self) -> str:
        names = [f"rank {r.get('rank')} pid {r.get('pid')} on {r.get('host')}" for r in self.records[:4]]
        names += [f"launcher pid {g}" for g in self.groups[: max(0, 4 - len(names))]]
        return ", ".join(names)


def leftovers(rd: RunDir, ssh_args: list[str] | None = None) -> Leftovers:
    """The processes of the newest attempt that still run (see :class:`Leftovers`): checked here for this machine,
    over ssh for the others (a host that cannot be reached counts its records as running: nobody can tell)."""
    attempt = rd.next_attempt() - 1
    out = Leftovers()
    if attempt < 0:
        return out
    remote: dict[str, list[PidRecord]] = {}
    for rec in rd.records("pids", attempt):
        try:
            if is_local(str(rec["host"])):
                if is_alive(int(rec["pid"]), rec.get("start_time")) or (
                    rec.get("ppid_start_time") and is_alive(int(rec["ppid"]), rec["ppid_start_time"])
                ):
                    out.records.append(rec)
            else:
                remote.setdefault(str(rec["host"]), []).append(rec)
        except (KeyError, TypeError, ValueError):
            continue
    looked = signal_hosts({h: targets_from_records(recs) for h, recs in remote.items()}, "0", list(ssh_args or []))
    for host, recs in remote.items():
        ok, alive = looked[host]
        out.records += [r for r in recs if not ok or int(r["pid"]) in alive or int(r.get("ppid") or 0) in alive]
    try:
        lines = rd.events.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            e = json.loads(line)
            if e.get("event") == "spawn" and e.get("attempt") == attempt and e.get("start_time"):
                if is_alive(int(e["pid"]), int(e["start_time"])):
                    out.groups.append(int(e["pid"]))
        except (ValueError, TypeError, AttributeError, KeyError):
            continue
    return out


@dataclass
class Ownership:
    """Held by ``ftkit launch`` for its whole life: ``acquire()`` first, ``release()`` in a ``finally``."""

    rd: RunDir
    ssh_args: list[str] = field(default_factory=list)
    me: Owner = field(default_factory=Owner.me)
    _fd: int | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    taken_over: list[PidRecord] = field(default_factory=list)

    @property
    def owner_path(self) -> Path:
        return self.rd.meta / "owner.json"

    @property
    def heartbeat_path(self) -> Path:
        return self.rd.meta / "supervisor.json"

    def acquire(
        self,
        *,
        takeover: bool = False,
        teardown: Callable[[Leftovers], object] | None = None,
        echo: Callable[[str], None] = print,
    ) -> None:
        """Become the run's owner or raise RunBusy naming who owns it and how to stop it. Ranks of a dead supervisor
        that stop themselves (their watchdog) are waited for, with a line saying so (``echo``)."""
        self._echo = echo
        meta = self.rd.meta
        try:
            meta.mkdir(parents=True, exist_ok=True)
            fd = os.open(meta / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise os_error(e, meta / "lock", "cannot create the run directory's lock") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            other = self._read_quietly()
            who = other.describe() if other else "another ftkit launch"
            raise RunBusy(self._busy(who)) from None
        self._fd = fd
        try:
            self._claim(takeover, teardown)
        except BaseException:
            self.release()
            raise
        self._start_heartbeat()

    def _read_quietly(self) -> Owner | None:
        try:
            return read_owner(self.rd)
        except UserError:
            return None

    def _busy(self, who: str) -> str:
        return (
            f"{self.rd.path}: a live job owns this run directory ({who}); "
            f"stop it with `ftkit stop {self.rd.path}` or use another train.output_dir"
        )

    def _claim(self, takeover: bool, teardown: Callable[[Leftovers], object] | None) -> None:
        for _ in range(3):
            old = read_owner(self.rd)
            if old is not None:
                state = owner_state(old, self.ssh_args)
                if state == "alive":
                    raise RunBusy(self._busy(old.describe()))
                if state == "unknown" and not takeover:
                    raise RunBusy(
                        f"{self.rd.path}: the owner record names {old.describe()}, and {old.host} cannot be reached "
                        "to tell whether it still runs; if it does not, launch with --takeover"
                    )
            # A supervisor that ended cleanly removed its record after its teardown: only a dead owner's record
            # can leave ranks behind.
            orphans = leftovers(self.rd, self.ssh_args) if old is not None else Leftovers()
            if orphans and not takeover and orphans.stop_themselves() is not None:
                if self._wait_for_orphans(old, orphans):
                    return
                orphans = leftovers(self.rd, self.ssh_args)
            if orphans:
                names = orphans.describe()
                if not takeover:
                    raise RunBusy(
                        f"{self.rd.path}: its supervisor is gone but ranks of its last attempt still run ({names}); "
                        f"launch with --takeover to stop them and continue, or `ftkit stop --force {self.rd.path}`"
                    )
                if teardown is not None:
                    teardown(orphans)
                self.taken_over = orphans.records
            if old is not None and read_owner(self.rd) is not None:
                self._drop_stale_record()
            if self._link_record():
                return
        raise RunBusy(self._busy("another ftkit launch starting at the same moment"))

    def _wait_for_orphans(self, old: Owner | None, orphans: Leftovers) -> bool:
        """Become the owner, which every orphaned rank's watchdog reads as "taken over": each saves the step in
        flight (the graceful stop) and ends. Wait for that, bounded by their own orphan_timeout_s + stop_timeout_s.
        True: owned, nothing of the old run left; False: something still runs (the record is given back)."""
        bound = float(orphans.stop_themselves() or 0.0) + WAIT_SLACK_S
        if old is not None:
            self._drop_stale_record()
        if not self._link_record():
            return False
        self._echo(
            f"ftkit: the run's supervisor is gone and its ranks still run ({orphans.describe()}); they stop "
            f"themselves, saving the step in flight first: waiting for them (at most {bound:.0f}s)"
        )
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if not leftovers(self.rd, self.ssh_args):
                self._echo("ftkit: the orphaned ranks have stopped")
                return True
            time.sleep(ORPHAN_POLL_S)
        self._unlink_own_record()
        return False

    def _drop_stale_record(self) -> None:
        stale = self.owner_path.with_name(f".owner.stale-{secrets.token_hex(4)}")
        try:
            os.rename(self.owner_path, stale)
            stale.unlink()
        except FileNotFoundError:
            pass  # another launcher moved it first; the link decides who wins

    def _unlink_own_record(self) -> None:
        try:
            current = read_owner(self.rd)
        except UserError:
            return
        if current is not None and current.pid == self.me.pid and current.host == self.me.host:
            self.owner_path.unlink(missing_ok=True)

    def _link_record(self) -> bool:
        tmp = self.owner_path.with_name(f".owner.{os.getpid()}.{secrets.token_hex(4)}")
        atomic_write(tmp, self.me.to_json())
        try:
            os.link(tmp, self.owner_path)  # atomic and exclusive, NFS included
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _beat(self, seq: int) -> None:
        try:
            atomic_write(
                self.heartbeat_path,
                json.dumps({"pid": self.me.pid, "host": self.me.host, "seq": seq, "time": time.time()}),
                fsync=False,
            )
        except OSError:
            pass  # a full disk: the supervisor reports it where it writes; ranks then see silence

    def _start_heartbeat(self) -> None:
        self._beat(0)  # the first beat is on disk before anything is spawned

        def beat() -> None:
            seq = 0
            while not self._stop.wait(HEARTBEAT_S):
                seq += 1
                self._beat(seq)

        self._thread = threading.Thread(target=beat, name="ftkit-supervisor-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat, remove the owner record (only if it is still ours) and drop the lock."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            current = read_owner(self.rd)
        except UserError:
            current = None
        if current is not None and current.pid == self.me.pid and current.host == self.me.host:
            for p in (self.owner_path, self.heartbeat_path):
                try:
                    p.unlink()
                except OSError:
                    pass
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None


# ----------------------------------------------------------------------------------------------------- stopping


def stop_leftovers(left: Leftovers, ssh_args: list[str], echo: Callable[[str], None] = print) -> bool:
    """Tear down what a dead supervisor left on every host (ranks, their per-node agents, the engine launchers it
    spawned here), then the run's /dev/shm buffers. True when nothing is left."""

    records = left.records
    res = teardown(left.groups, targets_from_records(records), grace_s=10.0, ssh_args=ssh_args)
    # The launchers were children of the dead supervisor: init reaps them a moment after they die.
    end = time.monotonic() + 5.0
    while time.monotonic() < end and any(group_exists(g) for g in left.groups):
        time.sleep(0.05)
    remove_shm([r for r in records if r.get("host") not in set(res.unreachable)], ssh_args)
    stopped = len(res.signalled)
    echo(f"ftkit: stopped {stopped} process(es) of the run" + (f"; left: {', '.join(res.left)}" if res.left else ""))
    if res.unreachable:
        echo(f"ftkit: could not reach {', '.join(sorted(set(res.unreachable)))}: stop its processes there by hand")
    return res.clean


def caller_ssh_args(ssh_config: str | None) -> list[str]:
    """ssh options for ``ftkit status``/``ftkit stop``: the caller's own ssh configuration (``~/.ssh/config``), or the
    file the caller names. Never configuration read from the run directory: on shared storage anyone who can write
    a run directory could otherwise run commands (a ``ProxyCommand``) as whoever inspects the run."""
    return ["-F", ssh_config] if ssh_config else []


def _signal_owner(owner: Owner, ssh_args: list[str]) -> None:
    import signal

    if owner.same_boot or (owner.named_here and not owner.boot_id):
        if is_alive(owner.pid, owner.start_time):
            os.kill(owner.pid, signal.SIGTERM)
        return
    remote_signal(owner.host, [Target(owner.host, owner.pid, owner.start_time)], "TERM", ssh_args)


def stop_run(
    run_dir: str,
    *,
    force: bool = False,
    timeout: float = 180.0,
    echo: Callable[[str], None] = print,
    ssh_config: str | None = None,
) -> int:
    """``ftkit stop``: SIGTERM the live supervisor (a graceful stop: the step in flight is saved) and wait until it
    and the ranks are gone; with ``force``, SIGTERM twice (no save), and when the supervisor is gone (or cannot be
    reached), tear the ranks down by their pid records. Exit 0 when nothing of
    the run is left, 11 (RUN_BUSY) when something is. Other hosts are reached with the caller's ssh configuration
    (:func:`caller_ssh_args`)."""

    rd = RunDir(run_dir)
    if not rd.meta.is_dir():
        raise UserError(Problem("not an ftkit run directory (no ftkit/)", file=str(run_dir)))
    ssh_args = caller_ssh_args(ssh_config)
    owner = read_owner(rd)
    state = owner_state(owner, ssh_args) if owner else "dead"
    if state == "alive":
        assert owner is not None
        if force:  # two signals: the second ends the graceful stop's wait, so the run is torn down at once
            echo(f"ftkit: stopping its supervisor ({owner.describe()}) at once, without saving")
            _signal_owner(owner, ssh_args)
            time.sleep(0.5)
        else:
            echo(f"ftkit: asking its supervisor ({owner.describe()}) to save the step in flight and stop")
        _signal_owner(owner, ssh_args)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and owner_state(owner, ssh_args) == "alive":
            time.sleep(0.2)
        if owner_state(owner, ssh_args) == "alive":
            echo(f"ftkit: error: the supervisor ({owner.describe()}) still runs after {timeout:g}s")
            return ExitCode.RUN_BUSY
    elif state == "unknown" and not force:
        assert owner is not None
        echo(
            f"ftkit: error: {owner.host} cannot be reached to stop the supervisor ({owner.describe()}); "
            "use --force to stop the ranks by their pid records"
        )
        return ExitCode.RUN_BUSY
    left = leftovers(rd, ssh_args)
    if left:
        if not force:
            names = left.describe()
            echo(
                f"ftkit: error: its supervisor is gone but ranks still run ({names}); "
                f"use `ftkit stop --force {run_dir}`"
            )
            return ExitCode.RUN_BUSY
        if not stop_leftovers(left, ssh_args, echo):
            return ExitCode.RUN_BUSY
    echo(f"ftkit: nothing of the run in {run_dir} is running")
    return ExitCode.OK


def liveness(run_dir: str | os.PathLike[str], ssh_config: str | None = None) -> str | None:
    """One line for ``ftkit status``: who runs this run now, or that its ranks run unsupervised; None when idle.
    Other hosts are reached with the caller's ssh configuration (:func:`caller_ssh_args`)."""
    rd = RunDir(run_dir)
    owner = read_owner(rd)
    if owner is None:
        return None
    ssh_args = caller_ssh_args(ssh_config)
    state = owner_state(owner, ssh_args)
    if state == "alive":
        return f"running, supervised by ftkit launch ({owner.describe()}); `ftkit stop {rd.path}` stops it"
    if state == "unknown":
        return (
            f"its supervisor's host {owner.host} cannot be reached to tell whether it still runs ({owner.describe()})"
        )
    left = leftovers(rd, ssh_args)
    if left:
        return (
            f"NOT SUPERVISED: its supervisor ({owner.describe()}) is gone but {left.describe()} still run; "
            f"`ftkit launch --takeover` continues the run, `ftkit stop --force {rd.path}` stops them"
        )
    return None
