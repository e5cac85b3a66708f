"""Checks before anything is spawned: hosts reachable, run directory writable, master port free, same Python
and key package versions everywhere. Every failure is collected and raised once as PreflightError (exit 3).
"""

from __future__ import annotations

import errno
import socket
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .errors import PreflightError, Problem
from .procs import LOCAL_HOSTS, ssh_run

KEY_PACKAGES = ("torch", "deepspeed", "transformers", "accelerate", "peft", "ftkit")

# Printed by every host (python -c, importlib.metadata only: no heavy import, well under a second).
VERSION_PROBE = (
    "import sys, importlib.metadata as m\n"
    "def v(p):\n"
    "    try: return m.version(p)\n"
    "    except Exception: return 'missing'\n"
    "print('python=' + '.'.join(map(str, sys.version_info[:3])))\n"
    f"for p in {KEY_PACKAGES!r}: print(p + '=' + v(p))\n"
)


@dataclass
class PreflightReport:
    versions: dict[str, dict[str, str]]  # host -> name -> version
    checks: list[str]


def local_versions() -> dict[str, str]:
    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for p in KEY_PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "missing"
    return out


def _parse_versions(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def port_free(addr: str, port: int) -> str | None:
    """None when ``port`` can be bound on ``addr`` (the master host is this machine), else why not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As torch's TCPStore does: connections of a run that just ended linger in TIME_WAIT for a minute and
        # must not block a relaunch; a port something is listening on is still refused.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} on {addr} is already in use (another job?); set cluster.master_port"
            if e.errno == errno.EADDRNOTAVAIL:
                return None  # not an address of this machine: the master is remote, checked there
            return f"cannot bind {addr}:{port}: {e.strerror}"
    return None


def run_dir_writable(path: Path) -> str | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ftkit-write-test-"):
            pass
    except OSError as e:
        return f"run directory {path} is not writable: {e.strerror or e}"
    return None


def run_preflight(
    *,
    hosts: list[tuple[str, int]],
    master_addr: str,
    master_port: int,
    run_dir: Path,
    engine: str,
    ssh_args: list[str],
    python: str = sys.executable,
) -> PreflightReport:
    problems: list[Problem] = []
    checks: list[str] = []
    mine = local_versions()
    versions = {"localhost": mine}
    err = run_dir_writable(run_dir)
    if err:
        problems.append(Problem(err, key="train.output_dir"))
    else:
        checks.append(f"run directory {run_dir} writable")
    for name in ("torch", "transformers", engine if engine != "torchrun" else "torch"):
        if mine.get(name) == "missing":
            problems.append(Problem(f"{name} is not installed on this machine (pip install {name})"))
    remote = [h for h, _ in hosts if h not in LOCAL_HOSTS]
    for host in remote:
        ok, out = ssh_run(
            host,
            f"{python} -c {_sh_quote(VERSION_PROBE)} && test -w {_sh_quote(str(run_dir))} && echo run_dir=writable",
            ssh_args,
            15,
        )
        if not ok:
            problems.append(
                Problem(
                    f"host {host} is not reachable over ssh ({out or 'timed out'}); "
                    "check the hostfile and passwordless ssh",
                    key="cluster.hostfile",
                )
            )
            continue
        theirs = _parse_versions(out)
        versions[host] = theirs
        if theirs.get("run_dir") != "writable":
            problems.append(
                Problem(
                    f"host {host}: run directory {run_dir} missing or not writable there "
                    "(it must be on storage every host shares)",
                    key="train.output_dir",
                )
            )
        if "python" not in theirs:
            problems.append(Problem(f"host {host}: {python} did not run there (same path on every host needed)"))
            continue
        diffs = [f"{k} {theirs.get(k, 'missing')} (this machine {v})" for k, v in mine.items() if theirs.get(k) != v]
        if diffs:
            problems.append(Problem(f"host {host} differs: " + "; ".join(diffs)))
        else:
            checks.append(f"host {host} reachable, same versions")
    # The master port must be free where rank 0's rendezvous will listen.
    if master_addr in LOCAL_HOSTS or _is_local_address(master_addr):
        err = port_free(master_addr, master_port)
        if err:
            problems.append(Problem(err, key="cluster.master_port"))
        else:
            checks.append(f"master port {master_addr}:{master_port} free")
    elif remote:
        ok, out = ssh_run(
            hosts[0][0],
            f'{python} -c "import socket; s=socket.socket(); '
            f"s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('{master_addr}', {master_port})); print('free')\"",
            ssh_args,
            15,
        )
        if ok and "free" not in out:
            problems.append(
                Problem(
                    f"port {master_port} on {master_addr} is already in use; set cluster.master_port",
                    key="cluster.master_port",
                )
            )
        elif ok:
            checks.append(f"master port {master_addr}:{master_port} free")
    if problems:
        raise PreflightError("\n".join(str(p) for p in problems))
    return PreflightReport(versions=versions, checks=checks)


def _is_local_address(addr: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _sh_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)
