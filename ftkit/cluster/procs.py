"""Processes of a run: what an exit code means, whether a recorded pid is still ours, and teardown by pid.

Teardown never matches command lines: it signals the process groups ftkit spawned and the pids the ranks
recorded themselves (with their start time, so a recycled pid is never signalled), on every host, first SIGTERM,
then after a grace period SIGKILL, and reports what is left and which hosts could not be reached.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from ftkit.cluster.fanout import run_on_hosts
from ftkit.cluster.hosts import LOCAL_HOSTS as LOCAL_HOSTS
from ftkit.cluster.hosts import is_local

if TYPE_CHECKING:
    from ftkit.cluster.fanout import Transport


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

    def as_dict(self) -> dict[str, list[str] | bool]:
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


# ``a PID START``: true while PID runs (not a zombie) and, when START is not empty, started at START (field 22 of
# /proc/PID/stat, read after the ")" that ends the command name, which may hold spaces).
_ALIVE_FN = (
    'a() { p=$1; w=$2; s=$(cat /proc/$p/stat 2>/dev/null) || return 1; s=${s##*") "}; set -- $s; '
    '[ "$1" != Z ] && [ "$1" != X ] && { [ -z "$w" ] || [ "${20}" = "$w" ]; }; }'
)


def _living_fn(targets: list[Target]) -> str:
    """``l``: sets ``L`` to the targets that still run. Pids and start times come from pid records on disk: every
    one is quoted here, where the line is built, so a record holding ``1; touch x`` never matches, never runs."""
    checks = []
    for t in targets:
        pid = str(t.pid)
        if not pid.isdigit():
            continue  # not a pid: nothing to signal
        checks.append(f'a {shlex.quote(pid)} {shlex.quote(str(t.start_time or ""))} && L="$L {pid}"')
    return "l() { L=; " + "".join(f"{c}; " for c in checks) + "}"


def _remote_script(targets: list[Target], sig: str) -> str:
    """A POSIX sh line that signals each target still running (start time matching), then lists them (``alive``)."""
    if sig not in ("TERM", "KILL", "0"):
        raise ValueError(f"signal {sig!r}")  # a programming error: callers pass constants
    cont = "kill -CONT $p 2>/dev/null; " if sig == "TERM" else ""  # a stopped process acts on TERM only then
    return (
        f"{_ALIVE_FN}; {_living_fn(targets)}; l; "
        f"for p in $L; do kill -{sig} $p 2>/dev/null; {cont}echo alive $p; done; true"
    )


def teardown_script(targets: list[Target], grace_s: float, verify_s: float = 5.0) -> str:
    """The whole teardown of one host as one POSIX sh line, so every host spends its grace period at once:
    SIGTERM + SIGCONT (``term PID``), wait up to ``grace_s`` for them to go, SIGKILL the rest (``kill PID``), wait
    up to ``verify_s`` and list what still runs (``left PID``)."""
    grace = max(0, round(grace_s * 10))
    verify = max(1, round(verify_s * 10))
    wait = 'i=0; while [ -n "$L" ] && [ $i -lt {n} ]; do sleep 0.1; l; i=$((i+1)); done'
    return (
        f"{_ALIVE_FN}; {_living_fn(targets)}; l; "
        "for p in $L; do kill -TERM $p 2>/dev/null; kill -CONT $p 2>/dev/null; echo term $p; done; "
        f"{wait.format(n=grace)}; "
        "for p in $L; do kill -KILL $p 2>/dev/null; echo kill $p; done; "
        f"{wait.format(n=verify)}; "
        "for p in $L; do echo left $p; done; true"
    )


def _pids(out: str, word: str) -> list[int]:
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith(word + " ") and line.split()[1:]]


def ssh_run(host: str, script: str, ssh_args: list[str], timeout: float) -> tuple[bool, str]:
    """Run ``script`` (a shell line whose values are already quoted) on ``host``; (reachable, stdout or why not).

    One host of :func:`ftkit.cluster.fanout.run_on_hosts`: this machine runs it locally, others over ssh. When
    unreachable the reason is one line (ssh's last words), so a caller's error stays one line per problem.
    """
    r = run_on_hosts([host], script, ssh_args, deadline_s=timeout + 2, connect_timeout_s=timeout)[host]
    return r.reachable, r.out


def remote_signal(
    host: str, targets: list[Target], sig: str, ssh_args: list[str], timeout: float = 10.0
) -> tuple[bool, set[int]]:
    """Signal (``TERM``, ``KILL``, or ``0`` to only look) the targets on ``host`` whose start time still matches;
    returns (host reachable, pids that were alive)."""
    return signal_hosts({host: targets}, sig, ssh_args, timeout)[host]


def signal_hosts(
    by_host: Mapping[str, list[Target]], sig: str, ssh_args: list[str], timeout: float = 10.0
) -> dict[str, tuple[bool, set[int]]]:
    """:func:`remote_signal` on every host at once: host -> (reachable, pids that were alive)."""
    res = run_on_hosts(
        list(by_host),
        lambda h: _remote_script(by_host[h], sig),
        ssh_args,
        deadline_s=timeout + 2,
        connect_timeout_s=timeout,
    )
    return {h: (r.reachable, set(_pids(r.out, "alive")) if r.reachable else set()) for h, r in res.items()}


def teardown(
    groups: Iterable[int],
    targets: Iterable[Target],
    *,
    grace_s: float,
    ssh_args: list[str],
    ssh_timeout: float = 10.0,
    transport: Transport | None = None,
    sleep=time.sleep,
    clock=time.monotonic,
) -> TeardownResult:
    """SIGTERM (+SIGCONT) every group and target, wait up to ``grace_s``, SIGKILL what is left, report the result.

    Every remote host runs its whole teardown (:func:`teardown_script`) in one ssh session, all hosts in parallel
    and alongside this machine's part: the grace period is spent once, and an unreachable host costs one ssh
    timeout in total.
    """
    res = TeardownResult()
    groups = list(groups)
    by_host: dict[str, list[Target]] = {}
    seen: set[tuple[str, int, int | None]] = set()
    for t in targets:
        host = "localhost" if is_local(t.host) else t.host
        if (host, t.pid, t.start_time) not in seen:  # an agent is named by the record of each of its ranks
            seen.add((host, t.pid, t.start_time))
            by_host.setdefault(host, []).append(t)
    local = by_host.pop("localhost", [])

    def local_alive() -> list[Target]:
        return [t for t in local if is_alive(t.pid, t.start_time)]

    def groups_alive() -> list[int]:
        return [g for g in groups if group_alive(g)]

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="teardown") as ex:
        remote = ex.submit(
            run_on_hosts,
            list(by_host),
            lambda h: teardown_script(by_host[h], grace_s),
            ssh_args,
            deadline_s=ssh_timeout + grace_s + 10,  # connect, grace, 5 s to verify, slack
            connect_timeout_s=ssh_timeout,
            transport=transport,  # srun inside a Slurm allocation (ftkit.cluster.slurm.transport_for); None: ssh
        )
        # SIGTERM, then SIGCONT: a stopped process (SIGSTOP, a debugger, a frozen rank) keeps SIGTERM pending until
        # it is continued, so without SIGCONT it would use up the whole grace period and need SIGKILL.
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
        deadline = clock() + grace_s
        while clock() < deadline and (local_alive() or groups_alive()):
            sleep(0.2)
        for g in groups_alive():
            signal_group(g, signal.SIGKILL)
            res.killed.append(f"group {g}")
        for t in local_alive():
            try:
                os.kill(t.pid, signal.SIGKILL)
                res.killed.append(f"{t.what or 'pid'} {t.pid}")
            except ProcessLookupError:
                pass
        # Give the kernel a moment to reap, then check nothing of ours is left.
        end = clock() + 5.0
        while clock() < end and (local_alive() or groups_alive()):
            sleep(0.1)
        res.left += [f"{t.what or 'pid'} {t.pid}" for t in local_alive()]
        res.left += [f"group {g}" for g in groups_alive()]
        for host, r in remote.result().items():
            if not r.reachable:
                res.unreachable.append(host)
                continue
            res.signalled += [f"{host}:{p}" for p in _pids(r.out, "term")]
            res.killed += [f"{host}:{p}" for p in _pids(r.out, "kill")]
            res.left += [f"{host}:{p}" for p in _pids(r.out, "left")]
    return res


class ProcessRecord(TypedDict, total=False):
    """What teardown reads of a process record on disk (a rank's pid record, a checkpoint agent's record)."""

    host: str  # the node's name in the hostfile
    pid: int
    start_time: int | None  # guards against pid reuse


class RankProcess(ProcessRecord, total=False):
    """A rank's pid record (``ftkit.rundir.records.PidRecord``), as far as teardown reads it."""

    rank: int
    ppid: int  # the per-node agent (launcher)
    ppid_start_time: int | None
    master_addr: str | None  # DeepSpeed's CPU collectives name their /dev/shm buffers after these
    master_port: str | None


def targets_from_records(records: Iterable[RankProcess]) -> list[Target]:
    """Rank pid records -> teardown targets (the rank itself; its parent too when that is a per-node agent)."""
    out = []
    for r in records:
        out.append(Target(r["host"], int(r["pid"]), r.get("start_time"), what=f"rank {r['rank']}"))
        if r.get("ppid_start_time") is not None and int(r.get("ppid", 1)) > 1:
            # The per-node agent (torchrun, deepspeed.launcher.launch): on a remote host nothing else stops it.
            out.append(Target(r["host"], int(r["ppid"]), r["ppid_start_time"], what=f"agent of rank {r['rank']}"))
    return out


def agent_targets(records: Iterable[ProcessRecord]) -> list[Target]:
    """Checkpoint agent records (ftkit.launch.tier) -> teardown targets: a copy in flight is stopped too."""
    return [
        Target(r["host"], int(r["pid"]), r.get("start_time"), what=f"checkpoint agent on {r['host']}") for r in records
    ]


SHM_DIR = "/dev/shm"
SHM_PREFIX = "deepspeed_allreduce_buffer_"  # DeepSpeed's CPU shared-memory collectives: ~70 MB per rank per run


def _shm_keys(records: Iterable[RankProcess]) -> dict[str, set[str]]:
    """host -> the run's part of its /dev/shm buffer names, ``_{master_addr}_{master_port}_`` (literal text)."""
    out: dict[str, set[str]] = {}
    for r in records:
        if r.get("master_addr") and r.get("master_port"):
            out.setdefault(str(r["host"]), set()).add(f"_{r['master_addr']}_{r['master_port']}_")
    return out


def _glob_literal(text: str) -> str:
    """``text`` as a glob that matches only itself (for fnmatch)."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in text)


def shm_patterns(records: Iterable[RankProcess]) -> dict[str, set[str]]:
    """host -> glob patterns of the run's /dev/shm buffers (named ``..._{master_addr}_{master_port}_{rank}``)."""
    return {host: {f"{SHM_PREFIX}*{_glob_literal(k)}*" for k in keys} for host, keys in _shm_keys(records).items()}


def remove_shm_script(keys: Iterable[str]) -> str:
    """``rm -f`` of the buffers on a remote host: the globs stay unquoted, the recorded address and port (from pid
    records on disk) are quoted once, here, so they are literal text to the remote shell."""
    return "rm -f " + " ".join(f"{SHM_DIR}/{SHM_PREFIX}*{shlex.quote(k)}*" for k in sorted(keys))


def remove_shm(
    records: Iterable[RankProcess], ssh_args: list[str], timeout: float = 10.0, transport: Transport | None = None
) -> list[str]:
    """Delete the run's shared-memory buffers on every host once its ranks are gone. DeepSpeed never removes
    them, so without this every attempt leaks ~70 MB of RAM per rank (hundreds of runs filled a 24 GB machine).
    Remote hosts are cleaned all at once. Returns the hosts that could not be reached."""
    import fnmatch

    records = list(records)
    keys = _shm_keys(records)
    remote = []
    for host, patterns in shm_patterns(records).items():
        if not is_local(host):
            remote.append(host)
            continue
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
    res = run_on_hosts(
        remote,
        lambda h: remove_shm_script(keys[h]),
        ssh_args,
        deadline_s=timeout + 2,
        connect_timeout_s=timeout,
        transport=transport,  # srun inside a Slurm allocation (ftkit.cluster.slurm.transport_for); None: ssh
    )
    return [h for h, r in res.items() if not r.reachable]
