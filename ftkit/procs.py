"""Processes of a run: what an exit code means, whether a recorded pid is still ours, and teardown by pid.

Teardown never matches command lines: it signals the process groups ftkit spawned and the pids the ranks
recorded themselves (with their start time, so a recycled pid is never signalled), on every host, first SIGTERM,
then after a grace period SIGKILL, and reports what is left and which hosts could not be reached.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

LOCAL_HOSTS = ("localhost", "127.0.0.1")  # how plans and hostfiles name this machine


def is_this_machine(host: str) -> bool:
    """A host name in a plan or pid record that means this machine (records carry the hostname too)."""
    return host in LOCAL_HOSTS or host == os.uname().nodename


def exit_meaning(code: int | None) -> str:
    """Say what an engine's exit code means: engines report a rank killed by signal N in different ways.

    Popen gives -N for a signal; shells and torchrun's agent 128+N; DeepSpeed's launcher exits with the rank's
    code modulo 256, so a SIGKILLed rank (-9) becomes 247 (256-9).
    """
    if code is None:
        return "still running"
    if code == 0:
        return "exit 0 (success)"
    if code < 0:
        return f"killed by {_signame(-code)}"
    if 256 - 64 < code < 256:
        return f"exit {code} (a rank killed by {_signame(256 - code)}, as DeepSpeed's launcher reports it)"
    if 128 < code < 128 + 64:
        return f"exit {code} (killed by {_signame(code - 128)})"
    return f"exit {code}"


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def proc_start_time(pid: int) -> int | None:
    """Start time of a local process in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            stat = fh.read()
    except OSError:
        return None
    rest = stat.rsplit(")", 1)[1].split()
    state = rest[0]
    if state in ("Z", "X"):
        return None  # a zombie is dead for our purposes
    return int(rest[19])


def is_alive(pid: int, start_time: int | None = None) -> bool:
    st = proc_start_time(pid)
    if st is None:
        return False
    return start_time is None or st == start_time


@dataclass
class Target:
    """A process to stop: pid on host, with its start time when known (guards against pid reuse)."""

    host: str
    pid: int
    start_time: int | None = None
    what: str = ""


@dataclass
class TeardownResult:
    signalled: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)  # needed SIGKILL
    left: list[str] = field(default_factory=list)  # still alive after SIGKILL
    unreachable: list[str] = field(default_factory=list)  # hosts ssh could not reach

    @property
    def clean(self) -> bool:
        return not self.left and not self.unreachable

    def as_dict(self) -> dict[str, Any]:
        return {
            "signalled": self.signalled,
            "killed": self.killed,
            "left": self.left,
            "unreachable": self.unreachable,
            "clean": self.clean,
        }


def group_alive(pgid: int) -> bool:
    """Does process group ``pgid`` still have a living member? Zombies do not count.

    ``killpg(pgid, 0)`` is not enough: it succeeds while the group's leader is an unreaped zombie, which is
    exactly the state of the engine launcher ftkit spawned (its Popen is reaped only after teardown), so
    teardown would wait the whole grace period, SIGKILL nothing and report the group as left.
    """
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        names = os.listdir("/proc")
    except OSError:
        return True  # no procfs: trust killpg
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                rest = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if rest[0] not in ("Z", "X") and int(rest[2]) == pgid:  # fields: state, ppid, pgrp
            return True
    return False


def group_exists(pgid: int) -> bool:
    """Any member at all, zombies included (group_alive ignores those: they need no signal, only reaping)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _remote_script(targets: list[Target], sig: str) -> str:
    """A POSIX sh snippet that signals each pid only if its start time still matches, then lists the living.

    Pids and start times come from pid records on disk: every one is quoted here, where the line is built, so a
    record holding ``1; touch x`` is a pid that never matches, not a command.
    """
    if sig not in ("TERM", "KILL", "0"):
        raise ValueError(f"signal {sig!r}")  # a programming error: callers pass constants
    parts = []
    for t in targets:
        pid = shlex.quote(str(t.pid))
        stat = shlex.quote(f"/proc/{t.pid}/stat")
        check = (
            f'[ "$(cut -d" " -f22 {stat} 2>/dev/null)" = {shlex.quote(str(t.start_time))} ]'
            if t.start_time
            else f"[ -e {shlex.quote(f'/proc/{t.pid}')} ]"
        )
        cont = f"kill -CONT {pid} 2>/dev/null; " if sig == "TERM" else ""  # a stopped process acts on TERM only then
        parts.append(f"if {check}; then kill -{sig} {pid} 2>/dev/null; {cont}echo alive {pid}; fi")
    return "; ".join(parts) + "; true"


# ssh reads a "host" that starts with '-' as an option (-oProxyCommand=... runs a local command): host names from
# pid records or plans must look like host names before they reach ssh's argv.
_SSH_HOST = re.compile(r"[A-Za-z0-9_.:%][A-Za-z0-9_.:%-]*")


def ssh_run(host: str, script: str, ssh_args: list[str], timeout: float) -> tuple[bool, str]:
    """Run ``script`` (a shell line whose values are already quoted) on ``host``; (reachable, stdout or why not).

    When unreachable the reason is one line (ssh's last words), so a caller's error stays one line per problem.
    """
    if not _SSH_HOST.fullmatch(host):
        return False, f"not a host name: {host!r}"
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}", *ssh_args, host, script]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 2, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, ""
    except OSError as e:  # no ssh client installed
        return False, f"cannot run ssh: {e.strerror or e}"
    if out.returncode == 255:  # ssh's own failure: the host cannot be reached
        return False, one_line(out.stderr)
    return True, out.stdout


def one_line(text: str) -> str:
    """ssh's stderr as one line: its messages joined, without the "Warning: Permanently added" noise."""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("Warning: Permanently added")]
    return "; ".join(lines)


def remote_signal(
    host: str, targets: list[Target], sig: str, ssh_args: list[str], timeout: float = 10.0
) -> tuple[bool, set[int]]:
    """Signal (``TERM``, ``KILL``, or ``0`` to only look) the targets on ``host`` whose start time still matches;
    returns (host reachable, pids that were alive)."""
    ok, out = ssh_run(host, _remote_script(targets, sig), ssh_args, timeout)
    alive = {int(line.split()[1]) for line in out.splitlines() if line.startswith("alive ")} if ok else set()
    return ok, alive


def teardown(
    groups: Iterable[int],
    targets: Iterable[Target],
    *,
    grace_s: float,
    ssh_args: list[str],
    ssh_timeout: float = 10.0,
    sleep=time.sleep,
    clock=time.monotonic,
) -> TeardownResult:
    """SIGTERM (+SIGCONT) every group and target, wait up to ``grace_s``, SIGKILL what is left, report the result."""
    res = TeardownResult()
    groups = list(groups)
    by_host: dict[str, list[Target]] = {}
    for t in targets:
        by_host.setdefault("localhost" if is_this_machine(t.host) else t.host, []).append(t)
    local = by_host.pop("localhost", [])

    def local_alive() -> list[Target]:
        return [t for t in local if is_alive(t.pid, t.start_time)]

    def groups_alive() -> list[int]:
        return [g for g in groups if group_alive(g)]

    # SIGTERM, then SIGCONT: a stopped process (SIGSTOP, a debugger, a frozen rank) keeps SIGTERM pending until it
    # is continued, so without SIGCONT it would use up the whole grace period and need SIGKILL.
    for g in groups:
        signal_group(g, signal.SIGTERM)
        signal_group(g, signal.SIGCONT)
        res.signalled.append(f"group {g}")
    for t in local_alive():
        try:
            os.kill(t.pid, signal.SIGTERM)
            os.kill(t.pid, signal.SIGCONT)
            res.signalled.append(f"{t.what or 'pid'} {t.pid}")
        except ProcessLookupError:
            pass
    remote_left: dict[str, list[Target]] = {}
    for host, ts in by_host.items():
        ok, out = ssh_run(host, _remote_script(ts, "TERM"), ssh_args, ssh_timeout)
        if not ok:
            res.unreachable.append(host)
            continue
        res.signalled += [f"{host}:{line.split()[1]}" for line in out.splitlines() if line.startswith("alive")]
        remote_left[host] = ts

    deadline = clock() + grace_s
    while clock() < deadline and (local_alive() or groups_alive()):
        sleep(0.2)
    if remote_left and clock() < deadline:
        sleep(max(0.0, min(2.0, deadline - clock())))

    for g in groups_alive():
        signal_group(g, signal.SIGKILL)
        res.killed.append(f"group {g}")
    for t in local_alive():
        try:
            os.kill(t.pid, signal.SIGKILL)
            res.killed.append(f"{t.what or 'pid'} {t.pid}")
        except ProcessLookupError:
            pass
    for host, ts in remote_left.items():
        ok, out = ssh_run(host, _remote_script(ts, "KILL"), ssh_args, ssh_timeout)
        if not ok:
            res.unreachable.append(host)
            continue
        res.killed += [f"{host}:{line.split()[1]}" for line in out.splitlines() if line.startswith("alive")]
    # Give the kernel a moment to reap, then check nothing of ours is left.
    end = clock() + 5.0
    while clock() < end and (local_alive() or groups_alive()):
        sleep(0.1)
    res.left += [f"{t.what or 'pid'} {t.pid}" for t in local_alive()]
    res.left += [f"group {g}" for g in groups_alive()]
    for host, ts in remote_left.items():
        if host in res.unreachable:
            continue
        ok, out = ssh_run(host, _remote_script(ts, "0"), ssh_args, ssh_timeout)
        if ok:
            res.left += [f"{host}:{line.split()[1]}" for line in out.splitlines() if line.startswith("alive")]
        else:
            res.unreachable.append(host)
    return res


def targets_from_records(records: Iterable[Mapping[str, Any]]) -> list[Target]:
    """Rank pid records -> teardown targets (the rank itself; its parent too when that is a per-node agent)."""
    out = []
    for r in records:
        out.append(Target(r["host"], int(r["pid"]), r.get("start_time"), what=f"rank {r['rank']}"))
        if r.get("ppid_start_time") is not None and int(r.get("ppid", 1)) > 1:
            # The per-node agent (torchrun, deepspeed.launcher.launch): on a remote host nothing else stops it.
            out.append(Target(r["host"], int(r["ppid"]), r["ppid_start_time"], what=f"agent of rank {r['rank']}"))
    return out


SHM_DIR = "/dev/shm"
SHM_PREFIX = "deepspeed_allreduce_buffer_"  # DeepSpeed's CPU shared-memory collectives: ~70 MB per rank per run


def _shm_keys(records: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
    """host -> the run's part of its /dev/shm buffer names, ``_{master_addr}_{master_port}_`` (literal text)."""
    out: dict[str, set[str]] = {}
    for r in records:
        if r.get("master_addr") and r.get("master_port"):
            out.setdefault(str(r["host"]), set()).add(f"_{r['master_addr']}_{r['master_port']}_")
    return out


def _glob_literal(text: str) -> str:
    """``text`` as a glob that matches only itself (for fnmatch)."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in text)


def shm_patterns(records: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
    """host -> glob patterns of the run's /dev/shm buffers (named ``..._{master_addr}_{master_port}_{rank}``)."""
    return {host: {f"{SHM_PREFIX}*{_glob_literal(k)}*" for k in keys} for host, keys in _shm_keys(records).items()}


def remove_shm_script(keys: Iterable[str]) -> str:
    """``rm -f`` of the buffers on a remote host: the globs stay unquoted, the recorded address and port (from pid
    records on disk) are quoted once, here, so they are literal text to the remote shell."""
    return "rm -f " + " ".join(f"{SHM_DIR}/{SHM_PREFIX}*{shlex.quote(k)}*" for k in sorted(keys))


def remove_shm(records: Iterable[Mapping[str, Any]], ssh_args: list[str], timeout: float = 10.0) -> list[str]:
    """Delete the run's shared-memory buffers on every host once its ranks are gone. DeepSpeed never removes
    them, so without this every attempt leaks ~70 MB of RAM per rank (hundreds of runs filled a 24 GB machine).
    Returns the hosts that could not be reached."""
    import fnmatch

    unreachable = []
    records = list(records)
    keys = _shm_keys(records)
    for host, patterns in shm_patterns(records).items():
        if is_this_machine(host):
            try:
                names = os.listdir(SHM_DIR)
            except OSError:
                continue
            for name in names:
                if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    try:
                        os.unlink(os.path.join(SHM_DIR, name))
                    except OSError:
                        pass
        else:
            ok, _ = ssh_run(host, remove_shm_script(keys[host]), ssh_args, timeout)
            if not ok:
                unreachable.append(host)
    return unreachable
