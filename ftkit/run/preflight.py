"""Checks before anything is spawned: hosts reachable, run directory writable, master port free, same Python
and key package versions everywhere. Every failure is collected and raised once as PreflightError (exit 3).
"""

from __future__ import annotations

import errno
import os
import shlex
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ftkit.cluster.fanout import run_on_hosts
from ftkit.cluster.hosts import LOCAL_HOSTS, is_local_address
from ftkit.cluster.pkgversions import PACKAGES, probe_source, versions
from ftkit.cluster.slurm import transport_for
from ftkit.cluster.toolchain import ToolchainFacts
from ftkit.command.engines import pdsh_problems
from ftkit.errors import PreflightError, Problem

KEY_PACKAGES = PACKAGES  # the versions every host must agree on (ftkit.cluster.pkgversions)


def resolve_probe(addr: str, port: int) -> str:
    """Python (for ``python -c``) printing whether ``addr`` resolves there; the values are Python literals."""
    return (
        "import socket\n"
        "try:\n"
        f"    socket.getaddrinfo({addr!r}, {int(port)}, type=socket.SOCK_STREAM); print('master=resolves')\n"
        "except OSError as e:\n"
        "    print('master=unresolvable: ' + str(e))\n"
    )


def port_probe(addr: str, port: int, prefix: str = "") -> str:
    """Python (for ``python -c``) printing ``free``, ``in-use`` or ``error: why`` (after ``prefix``) for binding
    ``addr:port`` there."""
    return (
        "import errno, socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "try:\n"
        f"    s.bind(({addr!r}, {int(port)})); print({prefix!r} + 'free')\n"
        "except OSError as e:\n"
        f"    print({prefix!r} + ('in-use' if e.errno == errno.EADDRINUSE else 'error: ' + str(e)))\n"
    )


def resolves(addr: str, port: int) -> str | None:
    """None when ``addr`` resolves on this machine, else the resolver's reason."""
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        return getattr(e, "strerror", None) or str(e)
    return None


@dataclass
class PreflightReport:
    versions: dict[str, dict[str, str]]  # host -> name -> version
    checks: list[str]
    toolchain: dict[str, ToolchainFacts] = field(default_factory=dict)  # host -> facts for DeepSpeed's ops (doctor)


def local_versions() -> dict[str, str]:
    return versions(KEY_PACKAGES)


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
    if engine == "deepspeed" and remote:
        problems += [Problem(p, key="train.output_dir") for p in pdsh_problems(str(run_dir), python, master_addr)]
    # Every rank connects to master_addr: a name that does not resolve hangs each attempt until startup_timeout_s.
    if len(remote) < len(hosts):
        err = resolves(master_addr, master_port)
        if err:
            problems.append(
                Problem(f"master address {master_addr} does not resolve here: {err}", key="cluster.master_addr")
            )
    # The master port must be free where rank 0's rendezvous will listen: here, or on the first host when the
    # master is remote (probed in the same session as that host's versions).
    master_here = master_addr in LOCAL_HOSTS or is_local_address(master_addr)
    if master_here:
        err = port_free(master_addr, master_port)
        if err:
            problems.append(Problem(err, key="cluster.master_port"))
        else:
            checks.append(f"master port {master_addr}:{master_port} free")
    port_host = hosts[0][0] if remote and not master_here else None
    q = shlex.quote
    # Every value is quoted once, here, where the remote shell line is built (the probes hold them as Python
    # literals inside one quoted -c argument).
    port_line = f"{q(python)} -c {q(port_probe(master_addr, master_port, prefix='master_port='))}"
    # -S: the version scan needs no site processing (ftkit.cluster.pkgversions), ~10 ms of CPU per host instead of ~90.
    probe = probe_source() + resolve_probe(master_addr, master_port)
    version_line = f"{q(python)} -S -c {q(probe)} && test -w {q(str(run_dir))} && echo run_dir=writable"

    def line(host: str) -> str:
        if host not in remote:
            return port_line
        return f"{version_line}; {port_line}" if host == port_host else version_line

    fan = [*remote, *([port_host] if port_host and port_host not in remote else [])]

    transport = transport_for(engine, os.environ)
    results = run_on_hosts(fan, line, ssh_args, deadline_s=17, connect_timeout_s=15, transport=transport)
    for host in remote:
        r = results[host]
        if not r.reachable:
            problems.append(
                Problem(
                    f"host {host} is not reachable over ssh ({r.out or 'timed out'}); "
                    "check the hostfile and passwordless ssh",
                    key="cluster.hostfile",
                )
            )
            continue
        theirs = _parse_versions(r.out)
        theirs.pop("master_port", None)
        versions[host] = theirs
        master = theirs.pop("master", "")
        if master.startswith("unresolvable"):
            problems.append(
                Problem(
                    f"host {host}: master address {master_addr} does not resolve there{master[len('unresolvable') :]}",
                    key="cluster.master_addr",
                )
            )
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
    if port_host and results[port_host].reachable:
        port = _parse_versions(results[port_host].out).get("master_port", "")
        if port == "in-use":
            problems.append(
                Problem(
                    f"port {master_port} on {master_addr} is already in use; set cluster.master_port",
                    key="cluster.master_port",
                )
            )
        elif port == "free":
            checks.append(f"master port {master_addr}:{master_port} free")
    if problems:  # one line per problem: a message never spans lines (ssh's stderr is joined by ssh_run)
        raise PreflightError("\n".join(" ".join(str(p).split()) for p in problems))
    return PreflightReport(versions=versions, checks=checks)
