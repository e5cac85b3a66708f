"""Tier 2 test harness: N "hosts" as Linux network namespaces, each with its own sshd, on one machine.

Design (docs/design.md, Testing: multinode)::

    root namespace (pytest, the ftkit controller, the deepspeed launcher's pdsh, ssh clients)
      bridge ftk<tag>b  10.213.7.254/24   <- the head's address on the test network
        ├── ftk<tag>v0 ══ veth ══ eth0 10.213.7.1/24  in namespace ftk-<tag>-n0  ("node0": sshd :2222)
        └── ftk<tag>v1 ══ veth ══ eth0 10.213.7.2/24  in namespace ftk-<tag>-n1  ("node1": sshd :2222)

* **The head stays in the root namespace** and reaches every node over the bridge, which also carries the
  node-to-node traffic (gloo, c10d rendezvous). So the code under test (pytest, ``ftkit launch``, the
  ``deepspeed`` runner and its pdsh) runs unmodified; only what happens *on a node* runs inside a namespace,
  either through that node's sshd (the real path: pdsh/ssh) or directly with :meth:`NetnsCluster.exec_argv`.
* Every node's interface is called ``eth0``, so one ``GLOO_SOCKET_IFNAME=eth0`` works on all of them.
* The namespaces share everything but the network: the filesystem (same /work paths, same venv, same run
  directory: heartbeats and checkpoints written on a node are visible to the head), pids, users and the
  hostname (so torchrun needs ``--rdzv-conf is_host=1/0``, docs/design.md, Testing).
* Inside a node, ``node0``, ``node1``… and ``head`` resolve to their test addresses (``/etc/netns/<ns>/hosts``,
  which ``ip netns exec`` bind-mounts over ``/etc/hosts`` for sshd and everything it starts). On the head the
  names are ssh aliases only (:attr:`NetnsCluster.ssh_config`): pass addresses, not names, where the head itself
  connects (e.g. ``--master_addr``), or use :meth:`NetnsCluster.address`.
* Sessions started by sshd get sshd's minimal environment (``PATH=/usr/bin:/bin``…): commands sent over
  ssh/pdsh must name the interpreter by absolute path or export what they need, as the real launchers do.
* Only addresses the harness created are used: the /24 is checked against every route of the root namespace
  first, and with no subnet given the first free ``10.213.K.0/24`` (K from 7) is taken, so several clusters
  (parallel tests, several engineers on one machine) can coexist; creation is serialised by a lock file.
* Teardown (context-manager exit, also on failure): stop each sshd by the pid in its PidFile, kill whatever still
  runs in each namespace (``ip netns pids``: TERM, grace, KILL), delete the veths, the namespaces, the bridge and
  ``/etc/netns/<ns>``, then verify nothing is left (:meth:`NetnsCluster.leftovers`). Resources whose creating
  process died without teardown (names carry its pid) are removed by the next cluster's setup.

Use as a context manager (:func:`netns_cluster`) or through the ``netns2`` fixture (two hosts, in a conftest.py).
:func:`require_netns` skips the test when not root or when ``ip netns`` is unusable, and installs openssh-server/pdsh
with ``launch/install_multinode_deps.sh`` when they are missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from tests.helpers.paths import REPO

INSTALL_SCRIPT = REPO / "launch" / "install_multinode_deps.sh"
SSHD = "/usr/sbin/sshd"
PREFIX = "ftk"  # every link and namespace the harness creates starts with this
LOCK_DIR = Path(tempfile.gettempdir())
LOCK_FILE = LOCK_DIR / "ftkit-netns.lock"  # serialises subnet choice and creation between clusters
DEFAULT_PORT = 2222
_CMD_TIMEOUT = 15.0  # seconds, for every ip/ssh-keygen/sshd command the harness runs itself
_NS_RE = re.compile(rf"^{PREFIX}-([0-9a-f]{{6}})([0-9a-f]{{2}})-n(\d+)$")  # ftk-<pid:06x><rand:02x>-n<i>


class NetnsUnavailable(RuntimeError):
    """This machine cannot run the harness (not root, or network namespaces are not usable)."""


# ---------------------------------------------------------------------------------------------------------------
# small process helpers


def _run(
    argv: Sequence[str], timeout: float = _CMD_TIMEOUT, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"timed out after {timeout}s: {shlex.join(argv)}") from e
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it holds no resources and cannot be killed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def release_stale_pyenv_lock() -> bool:
    """Remove pyenv's rehash lock when no ``pyenv-rehash`` runs. Every ssh session to a node sources root's
    ~/.bashrc, whose ``pyenv init`` rehashes under a lock file in the shared home (``shims/.pyenv-shim``); a node
    killed while one of its shells held it leaves it behind, and every later session on every node then waits for
    it (60 s), far past ssh's timeouts: a loaded full run lost its last netns tests that way. Returns whether a
    lock was removed."""
    lock = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "shims" / ".pyenv-shim"
    if not lock.exists():
        return False
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"pyenv-rehash" in (entry / "cmdline").read_bytes():
                return False  # a live rehash holds it
        except OSError:
            continue
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    return True


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    left = [p for p in pids if pid_alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = [p for p in left if pid_alive(p)]
    return left


def _listening(pid: int, address: str, port: int) -> bool:
    """Whether ``address:port`` is listening in the network namespace of ``pid`` (read from /proc, so probing
    does not make sshd fork a session that could outlive it)."""
    want = f"{socket.htonl(int(ipaddress.IPv4Address(address))):08X}:{port:04X}"
    try:
        rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1] == want and r.split()[3] == "0A" for r in rows)  # 0A: TCP_LISTEN


def cmdline(pid: int | str) -> str:
    """A process's command line, its arguments joined by spaces; "(gone)" once it has ended."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def namespace_pids(namespace: str) -> list[int]:
    """Pids of the live processes in a namespace (``ip netns pids``), zombies left out."""
    proc = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit() and pid_alive(int(p))]


def kill_namespace_processes(namespace: str, grace_s: float = 2.0) -> list[int]:
    """TERM every process in ``namespace``, KILL what is left after ``grace_s``; returns the pids it signalled."""
    pids = namespace_pids(namespace)
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    for pid in _wait_gone(pids, grace_s):
        _kill(pid, signal.SIGKILL)
    # New processes may have been forked meanwhile (an sshd accepting a connection): sweep until empty.
    for _ in range(20):
        more = namespace_pids(namespace)
        if not more:
            break
        for pid in more:
            _kill(pid, signal.SIGKILL)
        _wait_gone(more, 1.0)
        pids += more
    return pids


# ---------------------------------------------------------------------------------------------------------------
# availability


def netns_problem() -> str | None:
    """Why this machine cannot run the harness, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces and per-namespace sshd need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"'ip netns add' is not usable here: {made.stderr.strip()}"
        up = _run(["ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up"], check=False)
        if up.returncode != 0:
            return f"'ip netns exec' is not usable here: {up.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def deps_missing() -> list[str]:
    missing = [] if os.access(SSHD, os.X_OK) else [SSHD]
    return missing + [tool for tool in ("ssh", "ssh-keygen", "pdsh") if shutil.which(tool) is None]


def ensure_deps(timeout: float = 600) -> None:
    """Install openssh-server and pdsh (``launch/install_multinode_deps.sh``) when any of them is missing."""
    if not deps_missing():
        return
    proc = _run(["sh", str(INSTALL_SCRIPT)], timeout=timeout, check=False)
    if proc.returncode != 0 or deps_missing():
        raise RuntimeError(
            f"{INSTALL_SCRIPT} failed (exit {proc.returncode}); still missing {deps_missing()}: "
            f"{(proc.stderr or proc.stdout).strip()}"
        )


def require_netns() -> None:
    """For tests: skip (with the reason) when the harness cannot run here; install sshd/pdsh when missing."""
    problem = netns_problem()
    if problem:
        pytest.skip(f"multinode harness unavailable: {problem}")
    ensure_deps()


# ---------------------------------------------------------------------------------------------------------------
# the cluster


@dataclass
class Node:
    """One namespace "host". ``alias`` is its ssh name (``node0``); ``address`` its eth0 address."""

    index: int
    alias: str
    namespace: str
    address: str
    host_veth: str  # the root-namespace end of its veth, a port of the bridge
    dir: Path  # sshd config, host key, pid file and log
    sshd_pid: int | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)  # the sshd we started (pid == sshd_pid)

    @property
    def sshd_config(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def pidfile(self) -> Path:
        return self.dir / "sshd.pid"

    @property
    def sshd_log(self) -> Path:
        return self.dir / "sshd.log"


@dataclass
class NetnsCluster:
    """A set of namespace hosts joined by a bridge that the head (root namespace) is on, each running sshd."""

    tag: str
    subnet: ipaddress.IPv4Network
    head_address: str
    bridge: str
    port: int
    workdir: Path
    nodes: list[Node] = field(default_factory=list)
    owns_workdir: bool = False
    owner_lock: IO[str] | None = field(default=None, repr=False)  # holds flock(_owner_lock_path) while we live
    # Sessions skip root's ~/.bashrc (Debian's bash sources it for ssh commands; this machine's runs `pyenv init`,
    # ~0.15 s of CPU per session, which 32 "hosts" sharing 2 cores would pay one after another).
    skip_bashrc: bool = False

    # -- paths and names ----------------------------------------------------------------------------------------

    @property
    def key(self) -> Path:
        """The client's private key (its public half is every node's AuthorizedKeysFile)."""
        return self.workdir / "id_ed25519"

    @property
    def ssh_config(self) -> Path:
        return self.workdir / "ssh_config"

    @property
    def aliases(self) -> list[str]:
        return [n.alias for n in self.nodes]

    def node(self, which: int | str | Node) -> Node:
        """A node by index, alias, namespace name or address."""
        if isinstance(which, Node):
            return which
        for n in self.nodes:
            if which in (n.index, n.alias, n.namespace, n.address):
                return n
        raise KeyError(which)

    def address(self, which: int | str | Node) -> str:
        return self.node(which).address

    # -- running things -----------------------------------------------------------------------------------------

    def ssh_argv(self, which: int | str | Node, command: str | Sequence[str], options: Sequence[str] = ()) -> list[str]:
        """``ssh -F CONFIG [OPTIONS] nodeN -- COMMAND`` (a sequence is shell-quoted for the remote shell)."""
        remote = command if isinstance(command, str) else shlex.join(command)
        return ["ssh", "-F", str(self.ssh_config), *options, self.node(which).alias, "--", remote]

    def ssh(
        self,
        which: int | str | Node,
        command: str | Sequence[str],
        timeout: float = 30,
        check: bool = True,
        options: Sequence[str] = (),
    ) -> subprocess.CompletedProcess:
        """Run a command on a node over ssh, from the head; stdout/stderr captured as text. ``options`` are
        extra ssh arguments, e.g. ``["-o", "ConnectTimeout=2"]``."""
        return _run(self.ssh_argv(which, command, options), timeout=timeout, check=check)

    def pdsh_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for pdsh (and so the deepspeed launcher) to reach the nodes: ``base`` (default: ours) plus
        ``PDSH_RCMD_TYPE=ssh`` and ``PDSH_SSH_ARGS_APPEND="-F CONFIG"``."""
        env = dict(os.environ if base is None else base)
        env["PDSH_RCMD_TYPE"] = "ssh"
        env["PDSH_SSH_ARGS_APPEND"] = f"-F {self.ssh_config}"
        return env

    def pdsh_argv(self, command: str, nodes: Sequence[int | str | Node] | None = None) -> list[str]:
        """``pdsh -S -w node0,node1 COMMAND`` (-S: exit with the largest remote exit code)."""
        targets = self.nodes if nodes is None else [self.node(n) for n in nodes]
        return ["pdsh", "-S", "-w", ",".join(n.alias for n in targets), command]

    def exec_argv(self, which: int | str | Node, argv: Sequence[str]) -> list[str]:
        """Run ``argv`` directly inside a node's namespace (no ssh): ``ip netns exec NS ARGV``."""
        return ["ip", "netns", "exec", self.node(which).namespace, *argv]

    def hostfile_text(self, slots: int = 1, nodes: Sequence[int | str | Node] | None = None) -> str:
        """A DeepSpeed hostfile naming the nodes by their ssh aliases."""
        targets = self.nodes if nodes is None else [self.node(n) for n in nodes]
        return "".join(f"{n.alias} slots={slots}\n" for n in targets)

    def write_hostfile(self, path: Path, slots: int = 1, nodes: Sequence[int | str | Node] | None = None) -> Path:
        path.write_text(self.hostfile_text(slots, nodes))
        return path

    # -- faults -------------------------------------------------------------------------------------------------

    def link_down(self, which: int | str | Node, side: str = "bridge") -> None:
        """Partition a node. ``side="bridge"`` (default) downs the bridge port, like a pulled cable: the node
        keeps its address and packets to or from it vanish, so peers block until a timeout. ``side="node"``
        downs ``eth0`` inside the node: its sends fail at once (no route)."""
        self._set_link(which, side, "down")

    def link_up(self, which: int | str | Node, side: str = "bridge") -> None:
        self._set_link(which, side, "up")

    def _set_link(self, which: int | str | Node, side: str, state: str) -> None:
        n = self.node(which)
        if side == "bridge":
            _run(["ip", "link", "set", n.host_veth, state])
        elif side == "node":
            _run(["ip", "-n", n.namespace, "link", "set", "eth0", state])
        else:
            raise ValueError(f"side must be 'bridge' or 'node', not {side!r}")

    def pids(self, which: int | str | Node) -> list[int]:
        """Live processes inside a node (its sshd, sessions, ranks)."""
        return namespace_pids(self.node(which).namespace)

    def kill_node(self, which: int | str | Node, sig: int = signal.SIGKILL, timeout: float = 5.0) -> list[int]:
        """Node loss: send ``sig`` to every process in the node, sshd included, and wait until they are gone.
        Returns the pids signalled. The network stays up (peers get "connection refused"); add
        :meth:`link_down` for a node that vanishes silently. :meth:`start_sshd` brings ssh back."""
        n = self.node(which)
        pids = namespace_pids(n.namespace)
        for pid in pids:
            _kill(pid, sig)
        left = _wait_gone(pids, timeout)
        if left and sig == signal.SIGKILL:
            raise RuntimeError(f"{n.alias}: pids {left} survived SIGKILL")
        # A process forked after the list was taken (sshd starting a session for a peer's copy) is not in it and
        # would go on writing into the node's memory after the test wiped it: kill until the namespace is empty.
        for _ in range(5 if sig == signal.SIGKILL else 0):
            late = [p for p in namespace_pids(n.namespace) if p not in pids]
            if not late:
                break
            for pid in late:
                _kill(pid, sig)
            pids += late
            if left := _wait_gone(late, timeout):
                raise RuntimeError(f"{n.alias}: pids {left} survived SIGKILL")
        release_stale_pyenv_lock()
        if not pid_alive(n.sshd_pid or -1):
            self._reap(n)
            n.sshd_pid = None
        return pids

    # -- sshd ---------------------------------------------------------------------------------------------------

    def start_sshd(self, which: int | str | Node, timeout: float = 10.0) -> int:
        """Start (or restart) a node's sshd; waits until it accepts connections; returns its pid."""
        n = self.node(which)
        if n.sshd_pid and pid_alive(n.sshd_pid):
            return n.sshd_pid
        self._spawn_sshd(n)
        return self._wait_sshd(n, timeout)

    def start_all_sshd(self, timeout: float = 20.0) -> None:
        """Start every node's sshd at once, then wait until all accept connections."""
        todo = [n for n in self.nodes if not (n.sshd_pid and pid_alive(n.sshd_pid))]
        for n in todo:
            self._spawn_sshd(n)
        for n in todo:
            self._wait_sshd(n, timeout)

    def _spawn_sshd(self, n: Node) -> None:
        n.pidfile.unlink(missing_ok=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # Debian's sshd wants its privilege-separation dir
        # -D: no daemonizing, so sshd stays our child and we reap it (this machine's pid 1 reaps no orphans).
        # `ip netns exec` execs sshd in place, so the child's pid is sshd's (and the PidFile's). A bad config
        # makes sshd exit at once: _wait_sshd reports its log.
        with open(n.sshd_log, "ab") as log:  # config errors go to stderr, before sshd opens its -E log
            n.process = subprocess.Popen(
                self.exec_argv(n, [SSHD, "-D", "-f", str(n.sshd_config), "-E", str(n.sshd_log)]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,  # a ^C in the test's terminal should reach pytest, not sshd
            )

    def _wait_sshd(self, n: Node, timeout: float) -> int:
        assert n.process is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if n.process.poll() is not None:
                break
            if n.pidfile.exists() and n.pidfile.read_text().strip().isdigit():
                n.sshd_pid = int(n.pidfile.read_text())
                if _listening(n.sshd_pid, n.address, self.port):
                    return n.sshd_pid
            time.sleep(0.02)
        log = n.sshd_log.read_text()[-2000:] if n.sshd_log.exists() else ""
        raise RuntimeError(f"{n.alias}: sshd did not come up on {n.address}:{self.port} within {timeout}s. {log}")

    def stop_sshd(self, which: int | str | Node, timeout: float = 5.0) -> None:
        """Stop a node's sshd by the pid in its PidFile (TERM, then KILL)."""
        n = self.node(which)
        pid = n.sshd_pid
        if n.pidfile.exists() and n.pidfile.read_text().strip().isdigit():
            pid = int(n.pidfile.read_text())
        if pid:
            _kill(pid, signal.SIGTERM)
            if _wait_gone([pid], timeout):
                _kill(pid, signal.SIGKILL)
                _wait_gone([pid], timeout)
        self._reap(n)
        n.sshd_pid = None

    def _reap(self, n: Node) -> None:
        if n.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.process.wait(timeout=5)
            n.process = None

    # -- teardown -----------------------------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Remove everything the cluster created; returns :meth:`leftovers` (empty when all is gone)."""
        errors: list[str] = []

        def stop(n: Node) -> None:
            self._record_sshd_pid(n)
            try:
                self.stop_sshd(n)
                kill_namespace_processes(n.namespace)
            except Exception as e:  # keep tearing down the rest
                errors.append(f"{n.alias}: {e}")

        with ThreadPoolExecutor(max_workers=16) as ex:  # every node at once: each waits for its processes
            list(ex.map(stop, self.nodes))
        errors += _delete_resources(self.tag, [n.index for n in self.nodes])
        left = self.leftovers(wait_s=5.0) + errors
        if self.owns_workdir and not left:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self.owner_lock is not None and not left:
            _owner_lock_path(self.tag).unlink(missing_ok=True)
            self.owner_lock.close()
            self.owner_lock = None
        return left

    def _record_sshd_pid(self, n: Node) -> None:
        if n.pidfile.exists() and n.pidfile.read_text().strip().isdigit():
            n.sshd_pid = int(n.pidfile.read_text())

    def leftovers(self, wait_s: float = 0.0) -> list[str]:
        """What of this cluster still exists: namespaces, links, /etc/netns dirs, live sshd pids. Namespace and
        veth removal finish asynchronously in the kernel, so this polls for up to ``wait_s`` seconds."""
        end = time.monotonic() + wait_s
        while True:
            left = _resources_of(self.tag)
            left += [f"sshd pid {n.sshd_pid} ({n.alias})" for n in self.nodes if n.sshd_pid and pid_alive(n.sshd_pid)]
            if not left or time.monotonic() >= end:
                return left
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------------------
# setup / teardown of kernel objects


def _names(tag: str, index: int) -> tuple[str, str]:
    return f"{PREFIX}-{tag}-n{index}", f"{PREFIX}{tag}v{index}"


def _owner_lock_path(tag: str) -> Path:
    return LOCK_DIR / f"ftkit-netns-{tag}.lock"


def _owner_alive(tag: str) -> bool:
    """Whether the process that created cluster ``tag`` still runs: it holds an flock on its owner lock file for
    its whole life (released by the kernel when it dies, whatever pid namespace it is in). Without the file, fall
    back to the pid encoded in the tag."""
    path = _owner_lock_path(tag)
    try:
        with path.open("r") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False
    except FileNotFoundError:
        owner = int(tag[:6], 16)
        return owner == os.getpid() or pid_alive(owner)


def _bridge_name(tag: str) -> str:
    return f"{PREFIX}{tag}b"


def _list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _list_links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def _resources_of(tag: str) -> list[str]:
    left = [f"namespace {ns}" for ns in _list_namespaces() if ns.startswith(f"{PREFIX}-{tag}-")]
    left += [f"link {link}" for link in _list_links() if link.startswith(f"{PREFIX}{tag}")]
    netns_etc = Path("/etc/netns")
    if netns_etc.is_dir():
        left += [f"{d}" for d in netns_etc.iterdir() if d.name.startswith(f"{PREFIX}-{tag}-")]
    return left


def _delete_resources(tag: str, indices: Sequence[int]) -> list[str]:
    errors: list[str] = []
    namespaces = {ns for ns in _list_namespaces() if ns.startswith(f"{PREFIX}-{tag}-")}
    namespaces |= {_names(tag, i)[0] for i in indices} & set(_list_namespaces())
    links = set(_list_links())
    with ThreadPoolExecutor(max_workers=16) as ex:
        list(ex.map(kill_namespace_processes, sorted(namespaces)))
    # One `ip -force -batch` (go on past a failure) for every link and namespace; what it could not delete shows
    # in its stderr, and in leftovers().
    cmds = [f"link del {link}" for link in sorted(link for link in links if link.startswith(f"{PREFIX}{tag}v"))]
    cmds += [f"netns del {ns}" for ns in sorted(namespaces)]  # deleting a veth deletes its eth0 end too
    if cmds:
        proc = _run(
            ["ip", "-force", "-batch", "-"], timeout=_CMD_TIMEOUT + len(cmds), check=False, input="\n".join(cmds)
        )
        errors += [
            f"ip -batch: {line}"
            for line in proc.stderr.splitlines()
            if line.strip() and "Cannot find device" not in line and not line.startswith("Command failed")
        ]
    if _bridge_name(tag) in links:
        proc = _run(["ip", "link", "del", _bridge_name(tag)], check=False)
        if proc.returncode != 0:
            errors.append(f"ip link del {_bridge_name(tag)}: {proc.stderr.strip()}")
    netns_etc = Path("/etc/netns")
    if netns_etc.is_dir():
        for d in netns_etc.iterdir():
            if d.name.startswith(f"{PREFIX}-{tag}-"):
                shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            netns_etc.rmdir()  # only when empty: another cluster (or the system) may use it
    return errors


def cleanup_stale() -> list[str]:
    """Remove clusters whose creating process is dead (it was killed before its teardown ran)."""
    removed = []
    tags = {m.group(1) + m.group(2) for ns in _list_namespaces() if (m := _NS_RE.match(ns))}
    tags |= {
        link[len(PREFIX) : len(PREFIX) + 8] for link in _list_links() if re.match(rf"^{PREFIX}[0-9a-f]{{8}}[vb]", link)
    }
    for tag in sorted(tags):
        if not _owner_alive(tag):
            _delete_resources(tag, [])
            for workdir in LOCK_DIR.glob(f"ftkit-netns-{tag}-*"):  # create_cluster's own mkdtemp, if it made one
                shutil.rmtree(workdir, ignore_errors=True)
            _owner_lock_path(tag).unlink(missing_ok=True)
            removed.append(tag)
    return removed


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for cmd in (["ip", "-j", "-4", "route", "show", "table", "all"], ["ip", "-j", "-4", "addr", "show"]):
        data = json.loads(_run(cmd).stdout or "[]")
        for entry in data:
            dsts = [entry.get("dst")] if "dst" in entry else []
            dsts += [f"{a['local']}/{a['prefixlen']}" for a in entry.get("addr_info", [])]
            for dst in dsts:
                if dst and dst != "default":
                    with contextlib.suppress(ValueError):
                        nets.append(ipaddress.ip_network(dst, strict=False))
    return nets


def _pick_subnet(requested: str | None) -> ipaddress.IPv4Network:
    used = _used_networks()
    candidates = [requested] if requested else [f"10.213.{k}.0/24" for k in range(7, 255)]
    for c in candidates:
        net = ipaddress.IPv4Network(c)
        clash = [u for u in used if isinstance(u, ipaddress.IPv4Network) and u.overlaps(net)]
        if not clash:
            return net
        if requested:
            raise RuntimeError(f"subnet {net} overlaps {clash[0]}, already in use on this machine; pick another")
    raise RuntimeError("no free 10.213.K.0/24 subnet left for a test cluster")


def _sshd_config(node: Node, port: int, authorized_keys: Path, skip_bashrc: bool = False) -> str:
    return "\n".join(
        [
            f"Port {port}",
            f"ListenAddress {node.address}",
            f"HostKey {node.dir / 'ssh_host_ed25519_key'}",
            f"AuthorizedKeysFile {authorized_keys}",
            f"PidFile {node.pidfile}",
            "StrictModes no",
            "UsePAM no",
            "PermitRootLogin yes",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "X11Forwarding no",
            "PrintMotd no",
            "PrintLastLog no",
            "UseDNS no",
            "MaxStartups 200",  # pdsh and launchers open many sessions at once
            "MaxSessions 200",
            "LogLevel ERROR",
            *(["SetEnv SHLVL=1"] if skip_bashrc else []),
            "",
        ]
    )


def _ssh_client_config(cluster: NetnsCluster) -> str:
    lines = []
    for n in cluster.nodes:
        lines += [f"Host {n.alias}", f"    HostName {n.address}", ""]
    match = " ".join([*cluster.aliases, *(n.address for n in cluster.nodes)])
    lines += [
        f"Host {match}",
        f"    Port {cluster.port}",
        "    User root",
        f"    IdentityFile {cluster.key}",
        "    IdentitiesOnly yes",
        "    StrictHostKeyChecking no",
        "    UserKnownHostsFile /dev/null",
        "    GlobalKnownHostsFile /dev/null",
        "    LogLevel ERROR",
        "    BatchMode yes",
        "    ConnectTimeout 5",
        # OpenSSH 9's default key exchange (sntrup761x25519, post-quantum) costs ~0.12 s of client CPU per
        # connection here; a real head node pays that once per host, but on this machine every "host" shares the
        # same 2 cores, so a 32-host fan-out would measure the CPU, not the fan-out. Plain curve25519: ~0.015 s.
        "    KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org",
        "",
    ]
    return "\n".join(lines)


def _build(cluster: NetnsCluster, n_nodes: int) -> None:
    hosts_lines = [f"{cluster.head_address} head"]
    for i in range(n_nodes):
        namespace, veth = _names(cluster.tag, i)
        node = Node(i, f"node{i}", namespace, str(cluster.subnet[i + 1]), veth, cluster.workdir / f"node{i}")
        cluster.nodes.append(node)
        hosts_lines.append(f"{node.address} {node.alias}")

    br = cluster.bridge
    # One `ip -batch` for every link and address (one process instead of ~7 per node: 32 nodes come up in a
    # fraction of the time). The bridge's nf_call_iptables stays a separate, optional command below.
    cmds = [f"link add {br} type bridge stp_state 0"]
    cmds += [f"addr add {cluster.head_address}/{cluster.subnet.prefixlen} dev {br}", f"link set {br} up"]
    for n in cluster.nodes:
        cmds += [
            f"netns add {n.namespace}",
            f"link add {n.host_veth} type veth peer name eth0 netns {n.namespace}",
            f"link set {n.host_veth} master {br}",
            f"link set {n.host_veth} up",
        ]
    _run_batch([], cmds, timeout=_CMD_TIMEOUT + len(cluster.nodes))

    def inside(n: Node) -> None:  # batch lines cannot name a namespace: one `ip -n NS -batch` per node
        up = ["link set lo up", f"addr add {n.address}/{cluster.subnet.prefixlen} dev eth0", "link set eth0 up"]
        _run_batch(["-n", n.namespace], up, timeout=_CMD_TIMEOUT)

    with ThreadPoolExecutor(max_workers=8) as ex:
        list(ex.map(inside, cluster.nodes))
    # Bridged frames must not go through iptables (br_netfilter): a host firewall would drop them.
    _run(["ip", "link", "set", br, "type", "bridge", "nf_call_iptables", "0"], check=False)
    base_hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
    for n in cluster.nodes:
        etc = Path("/etc/netns") / n.namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(base_hosts.rstrip("\n") + "\n# ftkit test cluster\n" + "\n".join(hosts_lines) + "\n")


def _run_batch(options: Sequence[str], cmds: Sequence[str], timeout: float) -> None:
    """``ip [OPTIONS] -batch -``: the commands in one process; stops at (and reports) the first that fails."""
    try:
        proc = subprocess.run(
            ["ip", *options, "-batch", "-"],
            input="\n".join(cmds) + "\n",
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"timed out after {timeout}s: ip -batch ({len(cmds)} commands)") from e
    if proc.returncode != 0:
        raise RuntimeError(f"ip -batch exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}")


def _write_keys_and_configs(cluster: NetnsCluster) -> None:
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ftkit-netns-test", "-f", str(cluster.key)])
    authorized = cluster.workdir / "authorized_keys"
    shutil.copy(cluster.key.with_suffix(".pub"), authorized)

    def host_key(n: Node) -> None:
        n.dir.mkdir(parents=True, exist_ok=True)
        hostkey = n.dir / "ssh_host_ed25519_key"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{n.alias}-hostkey", "-f", str(hostkey)])
        n.sshd_config.write_text(_sshd_config(n, cluster.port, authorized, cluster.skip_bashrc))

    with ThreadPoolExecutor(max_workers=8) as ex:
        list(ex.map(host_key, cluster.nodes))
    cluster.ssh_config.write_text(_ssh_client_config(cluster))


def create_cluster(
    n_nodes: int = 2,
    subnet: str | None = None,
    port: int = DEFAULT_PORT,
    workdir: Path | None = None,
    skip_bashrc: bool = False,
) -> NetnsCluster:
    """Build ``n_nodes`` namespace hosts with sshd running; the caller must call ``teardown()``.

    ``subnet``: a /24 (or smaller) the test owns, e.g. ``"10.213.7.0/24"``; must not overlap any route here.
    None picks the first free ``10.213.K.0/24``. Node i gets host address i+1, the head the last one.
    ``skip_bashrc``: ssh sessions do not source root's ~/.bashrc (for timing many hosts on one machine; the
    sessions then lack what .bashrc adds to PATH, which ftkit never relies on).
    """
    if not 1 <= n_nodes <= 64:
        raise ValueError(f"n_nodes must be 1..64, not {n_nodes}")
    problem = netns_problem()
    if problem:
        raise NetnsUnavailable(problem)
    ensure_deps()
    tag = f"{os.getpid() % 0x1000000:06x}{secrets.randbelow(256):02x}"
    owner_lock = _owner_lock_path(tag).open("w")
    fcntl.flock(owner_lock, fcntl.LOCK_EX)  # held until teardown: tells cleanup_stale() that we are alive
    cluster: NetnsCluster | None = None
    try:
        LOCK_FILE.touch(exist_ok=True)
        with LOCK_FILE.open("r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # subnet choice and creation must not interleave with another's
            cleanup_stale()
            net = _pick_subnet(subnet)
            if net.num_addresses - 2 < n_nodes + 1:
                raise ValueError(f"subnet {net} is too small for {n_nodes} nodes and the head")
            wd = Path(tempfile.mkdtemp(prefix=f"ftkit-netns-{tag}-")) if workdir is None else Path(workdir)
            wd.mkdir(parents=True, exist_ok=True)
            cluster = NetnsCluster(
                tag=tag,
                subnet=net,
                head_address=str(net[-2]),
                bridge=_bridge_name(tag),
                port=port,
                workdir=wd,
                owns_workdir=workdir is None,
                owner_lock=owner_lock,
                skip_bashrc=skip_bashrc,
            )
            _build(cluster, n_nodes)
    except BaseException:
        if cluster is not None:
            cluster.teardown()
        else:
            _owner_lock_path(tag).unlink(missing_ok=True)
            owner_lock.close()
        raise
    try:
        _write_keys_and_configs(cluster)
        cluster.start_all_sshd()
    except BaseException:
        cluster.teardown()
        raise
    return cluster


@contextlib.contextmanager
def netns_cluster(
    n_nodes: int = 2,
    subnet: str | None = None,
    port: int = DEFAULT_PORT,
    workdir: Path | None = None,
    skip_bashrc: bool = False,
) -> Iterator[NetnsCluster]:
    """Context manager around :func:`create_cluster`: always tears down, and fails if anything is left over."""
    release_stale_pyenv_lock()  # one an earlier run's killed node left would stall every session
    cluster = create_cluster(n_nodes, subnet=subnet, port=port, workdir=workdir, skip_bashrc=skip_bashrc)
    failed = False
    try:
        yield cluster
    except BaseException as e:
        failed = True
        left = cluster.teardown()
        if left:
            e.add_note(f"netns teardown also left: {left}")
        raise
    finally:
        if not failed:
            left = cluster.teardown()
            if left:
                raise RuntimeError(f"netns teardown left: {left}")


# ---------------------------------------------------------------------------------------------------------------
# stand-in ranks: something real for teardown to kill

# Runs inside a node (``ip netns exec``): a node "init" that reaps (a child subreaper, as a real host's init is:
# this machine's pid 1 reaps no orphans), forking a per-node agent (as torchrun's), which forks the ranks. Each
# rank writes its pid record exactly where and as ``RankContext.record_pid`` does, then waits to be killed.
# Forked, not exec'd: 16 nodes × (init + agent + ranks) cost a few MB, not a Python start-up each.
STANDIN_PROGRAM = r"""
import ctypes, json, os, signal, sys, time
run_dir, attempt, node, node_rank, first_rank, nranks = sys.argv[1:7]
attempt, node_rank, first_rank, nranks = int(attempt), int(node_rank), int(first_rank), int(nranks)
modes = sys.argv[7].split(",")
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us

def start_time(pid):
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[19])

def rank_main(rank, local_rank, mode):
    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank stuck in a collective: needs SIGKILL
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    pid, ppid = os.getpid(), os.getppid()
    rec = {
        "rank": rank, "local_rank": local_rank, "node_rank": node_rank, "host": node, "hostname": os.uname().nodename,
        "pid": pid, "start_time": start_time(pid), "ppid": ppid, "ppid_start_time": start_time(ppid),
        "pgid": os.getpgid(0), "attempt": attempt, "time": time.time(), "env": {}, "env_keys": [],
        "master_addr": None, "master_port": None,
    }
    d = os.path.join(run_dir, "ftkit", "attempts", str(attempt), "pids")
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".rank-{rank}.json.{pid}")
    with open(tmp, "w") as fh:
        json.dump(rec, fh)
    os.replace(tmp, os.path.join(d, f"rank-{rank}.json"))
    while True:
        signal.pause()

def agent_main():
    kids = []
    def forward(signum, frame):  # as torchrun's agent: pass SIGTERM on to the workers, then go
        for k in kids:
            try:
                os.kill(k, signal.SIGTERM)
            except ProcessLookupError:
                pass
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, forward)
    for i in range(nranks):
        pid = os.fork()
        if pid == 0:
            rank_main(first_rank + i, i, modes[i % len(modes)])
            os._exit(0)
        kids.append(pid)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            os._exit(0)

if os.fork() == 0:
    agent_main()
while True:  # the node's init: reap everything below until nothing is left
    try:
        os.wait()
    except ChildProcessError:
        break
"""


@dataclass
class StandIns:
    """Stand-in ranks on every node of a cluster (:func:`start_standins`); ``inits`` are the per-node reapers."""

    run_dir: Path
    attempt: int
    expected: int  # number of ranks
    inits: list[subprocess.Popen] = field(default_factory=list)

    def pid_files(self) -> list[Path]:
        d = self.run_dir / "ftkit" / "attempts" / str(self.attempt) / "pids"
        return sorted(d.glob("rank-*.json")) if d.is_dir() else []

    def wait_ready(self, timeout: float = 30.0) -> list[dict]:
        """Wait until every rank wrote its pid record; returns the records."""
        end = time.monotonic() + timeout
        while len(self.pid_files()) < self.expected:
            dead = [p.args for p in self.inits if p.poll() is not None]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"{len(self.pid_files())}/{self.expected} stand-in ranks ready; exited: {dead}")
            time.sleep(0.05)
        return [json.loads(p.read_text()) for p in self.pid_files()]

    def wait_gone(self, timeout: float = 10.0) -> list[int]:
        """Wait until every node's init exited (it does once all ranks and agents below it are gone); returns
        the pids of the inits still running."""
        end = time.monotonic() + timeout
        for p in self.inits:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, end - time.monotonic()))
        return [p.pid for p in self.inits if p.poll() is None]

    def kill(self) -> None:
        """Last resort for a failing test (the cluster's teardown kills whatever runs in the namespaces too)."""
        for p in self.inits:
            _kill(p.pid, signal.SIGKILL)
        for rec in (json.loads(f.read_text()) for f in self.pid_files()):
            for pid in (rec["pid"], rec["ppid"]):
                _kill(int(pid), signal.SIGKILL)
        self.wait_gone(5)


def start_standins(
    cluster: NetnsCluster,
    run_dir: Path,
    *,
    attempt: int = 0,
    ranks_per_node: int = 2,
    modes: Sequence[str] = ("exit",),
    nodes: Sequence[int | str | Node] | None = None,
) -> StandIns:
    """Start stand-in ranks on every node (or ``nodes``): per node an agent with ``ranks_per_node`` ranks, global
    ranks numbered in node order. ``modes`` cycles over each node's local ranks: ``exit`` dies on SIGTERM,
    ``ignore`` ignores it. Call :meth:`StandIns.wait_ready` before using the pid records."""
    import sys

    targets = cluster.nodes if nodes is None else [cluster.node(n) for n in nodes]
    s = StandIns(run_dir, attempt, ranks_per_node * len(targets))
    for i, n in enumerate(targets):
        argv = [sys.executable, "-c", STANDIN_PROGRAM, str(run_dir), str(attempt), n.alias, str(i)]
        argv += [str(i * ranks_per_node), str(ranks_per_node), ",".join(modes)]
        s.inits.append(subprocess.Popen(cluster.exec_argv(n, argv), stdin=subprocess.DEVNULL, start_new_session=True))
    return s
