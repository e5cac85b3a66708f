"""Run one shell line on many hosts at once: the single place ftkit fans out (preflight, teardown, the lost-host
probe, /dev/shm cleanup, leftover checks, doctor).

Hosts that name this machine run the line locally with ``sh -c``; the others over ssh (BatchMode, so a missing key
fails instead of prompting). All hosts run in parallel, at most ``concurrency`` at once, under ONE overall
deadline: an unreachable host costs one timeout in total, not one each, so 64 hosts with two down cost one ssh
timeout, not two.

Transport: ssh today. A Slurm transport (``srun --nodelist HOST``) fits as another :class:`Transport`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ftkit.cluster.hosts import is_local

# ssh reads a "host" that starts with '-' as an option (-oProxyCommand=... runs a local command): host names from
# pid records or plans must look like host names before they reach ssh's argv.
_SSH_HOST = re.compile(r"[A-Za-z0-9_.:%][A-Za-z0-9_.:%-]*")


def valid_host(host: str) -> bool:
    """Whether ``host`` can be handed to ssh as a destination (never an option)."""
    return bool(_SSH_HOST.fullmatch(host))


def one_line(text: str) -> str:
    """ssh's stderr as one line: its messages joined, without the "Warning: Permanently added" noise."""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("Warning: Permanently added")]
    return "; ".join(lines)


@dataclass(frozen=True)
class HostResult:
    host: str
    reachable: bool  # False: ssh itself failed (exit 255), timed out, or the host name is invalid
    out: str  # stdout when reachable; else one line saying why not (ssh's last words, "timed out")
    rc: int | None  # the remote command's exit status when reachable
    seconds: float


class Transport(Protocol):
    """How a line reaches a remote host: the argv that runs ``script`` there, and whether an exit status means the
    transport itself failed (the host is unreachable) rather than the command."""

    def argv(self, host: str, script: str, connect_timeout_s: float) -> list[str]: ...

    def unreachable(self, rc: int) -> bool: ...


@dataclass(frozen=True)
class Ssh:
    """OpenSSH client: ``ssh -o BatchMode=yes -o ConnectTimeout=N [ssh_args] HOST SCRIPT``; exit 255 is ssh's own."""

    ssh_args: tuple[str, ...] = ()

    def argv(self, host: str, script: str, connect_timeout_s: float) -> list[str]:
        timeout = max(1, int(connect_timeout_s))
        # `--`: a host name read from a run directory's records can never be taken for an option (-oProxyCommand=)
        return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", *self.ssh_args, "--", host, script]

    def unreachable(self, rc: int) -> bool:
        return rc == 255


def run_on_hosts(
    hosts: Sequence[str],
    script: str | Callable[[str], str],
    ssh_args: list[str],
    *,
    deadline_s: float,
    concurrency: int = 32,
    connect_timeout_s: float | None = None,
    transport: Transport | None = None,
) -> dict[str, HostResult]:
    """Run ``script`` (a shell line whose values are already quoted, or a function host -> line) on every host.

    Returns host -> :class:`HostResult` for every distinct host, in the order given. ``deadline_s`` bounds the
    whole call: whatever still runs then is killed and reported as timed out. ``connect_timeout_s`` (default:
    the deadline) is ssh's ConnectTimeout. ``transport`` defaults to ssh with ``ssh_args``.
    """
    start = time.monotonic()
    end = start + deadline_s
    tr = transport if transport is not None else Ssh(tuple(ssh_args))
    connect = deadline_s if connect_timeout_s is None else min(connect_timeout_s, deadline_s)
    order = list(dict.fromkeys(hosts))
    results: dict[str, HostResult] = {}
    todo = []
    for host in order:
        if not valid_host(host):
            results[host] = HostResult(host, False, f"not a host name: {host!r}", None, 0.0)
        else:
            todo.append(host)
    if todo:
        cancelled = threading.Event()
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(todo))), thread_name_prefix="fanout") as ex:
            futures = {
                h: ex.submit(_run_one, h, script(h) if callable(script) else script, tr, connect, end, cancelled)
                for h in todo
            }
            try:
                for h, f in futures.items():
                    results[h] = f.result()
            except BaseException:  # ^C: stop what runs, start nothing more
                cancelled.set()
                raise
    return {h: results[h] for h in order}


def _run_one(host: str, line: str, tr: Transport, connect: float, end: float, cancelled: threading.Event) -> HostResult:
    t0 = time.monotonic()
    if cancelled.is_set() or t0 >= end:
        return HostResult(host, False, "timed out (not started before the deadline)", None, 0.0)
    local = is_local(host)
    argv = ["sh", "-c", line] if local else tr.argv(host, line, min(connect, end - t0))
    try:
        # A session of its own: on timeout the whole tree goes (sh -c's children too, not only the shell).
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as e:  # no ssh client installed
        return HostResult(host, False, f"cannot run {argv[0]}: {e.strerror or e}", None, time.monotonic() - t0)
    try:
        out, err = proc.communicate(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        return HostResult(host, False, f"timed out after {time.monotonic() - t0:.1f}s", None, time.monotonic() - t0)
    except BaseException:
        _kill_tree(proc)
        raise
    seconds = time.monotonic() - t0
    if not local and tr.unreachable(proc.returncode):
        return HostResult(host, False, one_line(err) or f"exit {proc.returncode}", None, seconds)
    return HostResult(host, True, out, proc.returncode, seconds)


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a pipe held open by something outside the group: do not wait on it
        proc.kill()
        proc.wait()
