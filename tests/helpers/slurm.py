"""A real Slurm cluster for tests: munged + slurmctld + two slurmd, each slurmd in a network namespace of its own.

Layout (facts from /work/shared/SLURM.md, measured on this kind of machine)::

    root namespace: munged, slurmctld (listening on the bridge address), pytest and the Slurm clients
      bridge fsl<tag>b  10.214.K.254/24
        ├── veth ══ eth0 10.214.K.1  namespace fsl-<tag>-n1: slurmd -N n1, hostname n1, /etc/hosts bind-mounted
        └── veth ══ eth0 10.214.K.2  namespace fsl-<tag>-n2: slurmd -N n2, hostname n2

* slurmd is started with ``nsenter --net=... unshare --uts --mount`` (``ip netns exec`` remounts /sys and
  slurmd 22.05 then fails on cgroups); in its mount namespace /etc/hosts names n1, n2 and the controller, so
  jobs resolve each other and a rank-0 listener on ``n1:PORT`` is reachable from n2.
* Everything lives under one throwaway directory (state, spool, logs, the munge socket and key); clients find the
  cluster through ``SLURM_CONF`` (:attr:`SlurmCluster.env`). ``cred_expire=10`` and ``sched_interval=2`` bring a
  requeue→restart down to ~20 s.
* Stop (also on failure): cancel every job and wait for the steps to end, SIGTERM/SIGKILL every slurmd, then
  slurmctld, then munged (by pid), kill whatever still runs in the namespaces, delete them and the bridge, then
  :meth:`SlurmCluster.leftovers` must be empty.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

INSTALL = REPO / "launch" / "install_slurm_deps.sh"
LOCK = Path(tempfile.gettempdir()) / "ftkit-slurm.lock"
NODES = ("n1", "n2")
GRACE_S = 30  # preemption grace time of the low partition: the graceful stop (save + teardown) fits in it


def _run(argv: list[str], timeout: float = 15, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check, **kw)


def require_slurm() -> None:
    """Skip unless root with ``ip netns``; install Debian's Slurm and munge when missing."""
    if os.geteuid() != 0:
        pytest.skip("real Slurm tests need root (network namespaces, slurmd)")
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        pytest.skip("real Slurm tests need iproute2 and util-linux (nsenter, unshare)")
    r = subprocess.run(["sh", str(INSTALL)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"installing Slurm failed: {r.stderr[-2000:]}")


def _free_subnet() -> ipaddress.IPv4Network:
    routes = _run(["ip", "-4", "route", "show"]).stdout
    used = [ipaddress.ip_network(w.split()[0], strict=False) for w in routes.splitlines() if w[:1].isdigit()]
    for k in range(7, 250):
        net = ipaddress.ip_network(f"10.214.{k}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.214.K.0/24 subnet")


def _free_ports(n: int) -> int:
    """A base port with ``n`` consecutive free ports."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65000:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports")


@dataclass
class SlurmCluster:
    base: Path
    tag: str
    subnet: ipaddress.IPv4Network | None = None
    pids: dict[str, int] = field(default_factory=dict)  # daemon -> pid
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def ns(self, node: str) -> str:
        return f"fsl-{self.tag}-{node}"

    def address(self, node: str) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + (NODES.index(node) + 1))

    # ------------------------------------------------------------------------------------------------ clients

    def run(self, *argv: str, timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess:
        return _run(list(argv), timeout=timeout, check=check, env=self.env)

    def job(self, job_id: str | int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...); {} when unknown."""
        r = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        out: dict[str, str] = {}
        for word in r.stdout.split():
            k, _, v = word.partition("=")
            out.setdefault(k, v)
        return out

    def wait_state(self, job_id: str | int, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        end = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < end:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {info}")

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()

    # ------------------------------------------------------------------------------------------------ start

    def start(self) -> None:
        self.subnet = _free_subnet()
        self._network()
        self._files()
        self._munged()
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in NODES:
            hosts = self.base / f"hosts-{node}"
            line = f"mount --bind {hosts} /etc/hosts && hostname {node} && exec slurmd -D -N {node} -f {self.conf}"
            self._daemon(
                f"slurmd-{node}",
                [
                    "nsenter",
                    f"--net=/run/netns/{self.ns(node)}",
                    "unshare",
                    "--uts",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    line,
                ],
            )
        end = time.monotonic() + 30
        states = ""
        while time.monotonic() < end:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
            if set(states.splitlines()) == {"n1 idle", "n2 idle"}:  # one line per node and partition
                return
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode}: {self._log(name)}")
            time.sleep(0.2)
        raise RuntimeError(f"nodes not idle after 30 s: {states!r}; slurmctld log: {self._log('slurmctld')}")

    def _log(self, name: str) -> str:
        p = self.base / "log" / f"{name}.log"
        return p.read_text()[-2000:] if p.exists() else ""

    def _network(self) -> None:
        assert self.subnet is not None
        bridge = f"fsl{self.tag}b"
        head = f"{self.subnet.network_address + 254}/24"
        cmds = [f"link add {bridge} type bridge", f"addr add {head} dev {bridge}", f"link set {bridge} up"]
        self.links.append(bridge)
        for i, node in enumerate(NODES):
            ns, veth = self.ns(node), f"fsl{self.tag}v{i}"
            _run(["ip", "netns", "add", ns])
            self.namespaces.append(ns)
            self.links.append(veth)
            cmds += [
                f"link add {veth} type veth peer name eth0 netns {ns}",
                f"link set {veth} master {bridge}",
                f"link set {veth} up",
            ]
        _run(["ip", "-batch", "-"], input="\n".join(cmds) + "\n")
        for node in NODES:  # batch lines cannot name a namespace: one `ip -n NS -batch` per node
            inside = [f"addr add {self.address(node)}/24 dev eth0", "link set eth0 up", "link set lo up"]
            _run(["ip", "-n", self.ns(node), "-batch", "-"], input="\n".join(inside) + "\n")

    def _files(self) -> None:
        assert self.subnet is not None
        b = self.base
        for d in ("state", "log", "munge", "spool/n1", "spool/n2", "run"):
            (b / d).mkdir(parents=True, exist_ok=True)
        os.chmod(b / "munge", 0o755)
        _run(["mungekey", "-c", "-k", str(b / "munge" / "munge.key")])
        os.chmod(b / "munge" / "munge.key", 0o600)
        me = socket.gethostname().split(".")[0]
        ctl = str(self.subnet.network_address + 254)
        hosts = f"127.0.0.1 localhost\n{self.address('n1')} n1\n{self.address('n2')} n2\n{ctl} {me}\n"
        for node in NODES:
            (b / f"hosts-{node}").write_text(hosts)
        port = _free_ports(2)
        conf = {
            "ClusterName": "ftkittest",
            "SlurmctldHost": f"{me}({ctl})",
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={b}/munge/sock,cred_expire=10",
            "SlurmctldPort": port,
            "SlurmdPort": port + 1,
            "StateSaveLocation": f"{b}/state",
            "SlurmdSpoolDir": f"{b}/spool/%n",
            "SlurmctldPidFile": f"{b}/run/slurmctld.pid",
            "SlurmdPidFile": f"{b}/run/slurmd-%n.pid",
            "SlurmctldLogFile": f"{b}/log/slurmctld.log",
            "SlurmdLogFile": f"{b}/log/slurmd-%n.log",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "SchedulerParameters": "sched_interval=2,bf_interval=2",
            "PreemptType": "preempt/partition_prio",
            "PreemptMode": "REQUEUE",
            "SlurmctldParameters": "preempt_send_user_signal",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "MailProg": "/bin/true",
            "ReturnToService": 2,
            "KillWait": 5,
            "MinJobAge": 300,
            "MpiDefault": "none",
        }
        lines = [f"{k}={v}" for k, v in conf.items()]
        lines += [
            f"NodeName=n1 NodeAddr={self.address('n1')} CPUs=2 RealMemory=1000 State=UNKNOWN",
            f"NodeName=n2 NodeAddr={self.address('n2')} CPUs=2 RealMemory=1000 State=UNKNOWN",
            f"PartitionName=low Nodes=ALL Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_S}",
            "PartitionName=high Nodes=ALL PriorityTier=10 PreemptMode=OFF",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _munged(self) -> None:
        b = self.base / "munge"
        _run(
            [
                "munged",
                f"--socket={b}/sock",
                f"--key-file={b}/munge.key",
                f"--pid-file={b}/munged.pid",
                f"--log-file={b}/munged.log",
                f"--seed-file={b}/munged.seed",
                "--force",
            ]
        )
        self.pids["munged"] = int((b / "munged.pid").read_text().split()[0])

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.base / "log" / f"{name}.out", "w")  # noqa: SIM115
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env)
        log.close()
        self.procs[name] = p
        self.pids[name] = p.pid  # nsenter, unshare and sh all exec: the pid is slurmd's own

    # ------------------------------------------------------------------------------------------------ stop

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            ids = self.jobs()
            if ids:
                self.run("scancel", *ids, check=False)
                end = time.monotonic() + 20
                while time.monotonic() < end and self.jobs():
                    time.sleep(0.3)
        for ns in self.namespaces:  # whatever still runs on a node (slurmstepd, ranks) goes first
            self._kill_ns(ns, keep={self.pids.get(f"slurmd-{n}") for n in NODES})
        for name in [*(f"slurmd-{n}" for n in NODES), "slurmctld"]:
            self._stop_pid(name, grace=3)
        self._stop_pid("munged", grace=3)
        for ns in self.namespaces:
            self._kill_ns(ns, keep=set())
        for link in self.links[:1]:  # the bridge; the veths go with their namespaces
            _run(["ip", "link", "del", link], check=False)
        for ns in self.namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        for link in self.links[1:]:
            _run(["ip", "link", "del", link], check=False)

    def _stop_pid(self, name: str, grace: float) -> None:
        pid = self.pids.get(name)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + grace
        while time.monotonic() < end and _alive(pid):
            if name in self.procs:
                self.procs[name].poll()
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if name in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].wait(timeout=5)

    def _kill_ns(self, ns: str, keep: set[int | None]) -> None:
        r = _run(["ip", "netns", "pids", ns], check=False)
        pids = [int(p) for p in r.stdout.split() if p.isdigit() and int(p) not in keep]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, sig)
            end = time.monotonic() + 3
            while time.monotonic() < end and any(_alive(p) for p in pids):
                time.sleep(0.05)

    def leftovers(self) -> list[str]:
        out = [f"{name} pid {pid}" for name, pid in self.pids.items() if _alive(pid)]
        listed = _run(["ip", "netns", "list"], check=False).stdout
        out += [f"namespace {ns}" for ns in self.namespaces if ns in listed]
        links = _run(["ip", "-br", "link"], check=False).stdout
        out += [f"link {x}" for x in self.links if f"{x} " in links or f"{x}@" in links]
        return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without a SLURM_* variable (a shell outside any allocation), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    return {**env, **extra}


def slurm_ftkit(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``ftkit ARGS`` with exactly ``env`` (None: this process's environment)."""
    return subprocess.run(
        [sys.executable, "-m", "ftkit", *args], capture_output=True, text=True, env=env, timeout=120, cwd=cwd
    )


@contextlib.contextmanager
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Start a two-node cluster (about 1-2 s), yield it, stop every daemon by pid and check nothing is left."""
    require_slurm()
    base = Path(tempfile.mkdtemp(prefix="ftkit-slurm-"))
    os.chmod(base, 0o755)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one subnet choice at a time
        c = SlurmCluster(base, f"{os.getpid() % 0x10000:04x}{secrets.token_hex(1)}")
        try:
            c.start()
        except BaseException:
            c.stop()
            shutil.rmtree(base, ignore_errors=True)
            raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    try:
        yield c
    finally:
        c.stop()
        left = c.leftovers()
        shutil.rmtree(base, ignore_errors=True)
        assert not left, f"Slurm test cluster left: {left}"
