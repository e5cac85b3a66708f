"""Tier 2: the network-namespace harness itself (tests/helpers/netns.py) — ssh, pdsh, node-to-node TCP, partitions, node
loss, and a teardown that leaves nothing behind. Needs root; skips with the reason otherwise."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.netns import (
    LOCK_DIR,
    NetnsCluster,
    cleanup_stale,
    cmdline,
    namespace_pids,
    netns_cluster,
    pid_alive,
    require_netns,
)

pytestmark = pytest.mark.multinode

PORT = 29555  # the test's own listener inside node1

LISTENER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(b"pong")
    conn.close()
"""

CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        print(s.recv(16).decode())
except OSError as e:
    print(f"unreachable: {type(e).__name__}: {e}")
    sys.exit(3)
"""


def _start_listener(c: NetnsCluster, node: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        c.exec_argv(node, [sys.executable, "-c", LISTENER, c.address(node), str(PORT)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "listening"  # bounded by the test's timeout mark
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


def _client_in(c: NetnsCluster, node: int, target: int, timeout_s: float) -> subprocess.CompletedProcess:
    """Connect from inside ``node`` (directly, no ssh) to the listener on ``target``."""
    argv = c.exec_argv(node, [sys.executable, "-c", CLIENT, c.address(target), str(PORT), str(timeout_s)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 10)


@pytest.mark.timeout(60)
def test_ssh_from_head_reaches_each_node(netns2: NetnsCluster) -> None:
    for n in netns2.nodes:
        out = netns2.ssh(n, "hostname -I; ip -o -4 addr show dev eth0", timeout=20).stdout.split("\n")
        assert out[0].split() == [n.address]  # only eth0 (and lo) in the namespace
        assert f"inet {n.address}/24" in out[1]
    # Inside a node the other nodes and the head resolve by name.
    resolved = netns2.ssh(0, "getent hosts node1 head", timeout=20).stdout.split()
    assert resolved == [netns2.address(1), "node1", netns2.head_address, "head"]
    # The head is on the bridge, so it reaches the nodes with plain ip too.
    subnet = ipaddress.ip_network(netns2.subnet)
    assert ipaddress.ip_address(netns2.head_address) in subnet


@pytest.mark.timeout(60)
def test_pdsh_runs_on_every_node(netns2: NetnsCluster) -> None:
    proc = subprocess.run(
        netns2.pdsh_argv("echo ok $(hostname -I)"),
        env=netns2.pdsh_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"node{i}: ok {netns2.address(i)}" for i in (0, 1)]
    # -S hands back the largest remote exit code, which launchers rely on to notice a failed node.
    failing = subprocess.run(
        netns2.pdsh_argv("exit 7", nodes=[1]), env=netns2.pdsh_env(), capture_output=True, text=True, timeout=30
    )
    assert failing.returncode == 7


@pytest.mark.timeout(90)
def test_tcp_from_node0_to_node1_then_partition(netns2: NetnsCluster) -> None:
    listener = _start_listener(netns2, 1)
    try:
        # node0 -> node1 over the bridge, the path gloo and c10d take (client started over ssh, as ranks are).
        remote = [sys.executable, "-c", CLIENT, netns2.address(1), str(PORT), "5"]
        assert netns2.ssh(0, remote, timeout=30).stdout.strip() == "pong"

        # Pulled cable: packets to node1 vanish, so a connect blocks until its own timeout.
        netns2.link_down(1)
        t0 = time.monotonic()
        cut = _client_in(netns2, 0, 1, timeout_s=1.5)
        assert cut.returncode == 3 and "timed out" in cut.stdout, cut.stdout + cut.stderr
        assert time.monotonic() - t0 >= 1.4
        head = netns2.ssh(1, "true", check=False, timeout=30, options=["-o", "ConnectTimeout=1"])
        assert head.returncode == 255  # the head cannot reach it either

        # Back up: reachable again (the listener kept running through the partition).
        netns2.link_up(1)
        assert _client_in(netns2, 0, 1, timeout_s=5).stdout.strip() == "pong"

        # The node's own interface down: its sends fail at once instead of timing out.
        netns2.link_down(1, side="node")
        t0 = time.monotonic()
        fast = _client_in(netns2, 1, 0, timeout_s=5)
        assert fast.returncode == 3 and "unreachable" in fast.stdout
        assert time.monotonic() - t0 < 4
        netns2.link_up(1, side="node")
        assert netns2.ssh(1, "true", timeout=20).returncode == 0
    finally:
        _stop(listener)


@pytest.mark.timeout(60)
def test_kill_node_then_restart_sshd(netns2: NetnsCluster) -> None:
    # A "rank" left running on node1 by an ssh session, detached like a launched job.
    netns2.ssh(1, "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo started", timeout=20)
    # the node's sshd and the detached "rank"; not every pid listed now: the session's own processes may still be
    # ending (a CI run listed one that was gone by the kill: "{5229, 5232, 5335} <= {5229, 5335}"), and the detached
    # child may not have become `sleep` yet when the session returns (a local CI run: "[4360, 4362, 4464]", none of
    # them sleep): wait for it
    end = time.monotonic() + 10
    while not (rank := [p for p in netns2.pids(1) if cmdline(p) == "sleep 600"]) and time.monotonic() < end:
        time.sleep(0.05)
    sshd = netns2.node(1).sshd_pid
    assert len(rank) == 1 and sshd is not None, netns2.pids(1)
    killed = netns2.kill_node(1)
    assert {sshd, *rank} <= set(killed)
    assert netns2.pids(1) == []
    assert netns2.ssh(1, "true", check=False, timeout=30).returncode == 255  # refused: nothing listens
    assert netns2.ssh(0, "true", timeout=20).returncode == 0  # the other node is untouched
    netns2.start_sshd(1)
    assert netns2.ssh(1, "echo back", timeout=20).stdout.strip() == "back"


@pytest.mark.timeout(120)
def test_a_node_killed_while_its_shell_holds_pyenvs_rehash_lock_stalls_no_other_session(netns2: NetnsCluster) -> None:
    """Every session sources root's ~/.bashrc here, and its `pyenv init` rehashes under a lock in the shared home.
    A full run lost its last netns tests to a node killed while one of its shells held that lock: every later
    session on every node waited 60 s for it. kill_node now removes the lock its kill left."""
    import os

    lock = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "shims" / ".pyenv-shim"
    if not lock.parent.is_dir():
        pytest.skip("no pyenv shims here: nothing to hold")
    holder = subprocess.Popen(  # a shell on node1 holding the lock, as pyenv-rehash does with noclobber
        ["ssh", "-F", str(netns2.ssh_config), "node1", "--", f"set -o noclobber; : > {lock} && sleep 120"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not lock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.exists(), "node1's shell did not take the lock"
        netns2.kill_node(1)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert not lock.exists()
    t0 = time.monotonic()
    assert netns2.ssh(0, "true", timeout=30).returncode == 0
    assert time.monotonic() - t0 < 10, "a session on node0 waited on the lock"


@pytest.mark.timeout(90)
def test_teardown_leaves_nothing(tmp_path: Path) -> None:
    require_netns()
    with netns_cluster(2) as c:
        namespaces = [n.namespace for n in c.nodes]
        links = [c.bridge, *(n.host_veth for n in c.nodes)]
        sshd_pids = [n.sshd_pid for n in c.nodes]
        assert all(pid and pid_alive(pid) for pid in sshd_pids)
        workdir = c.workdir
        # A process the test "forgot": teardown must still kill it (it holds the namespace alive).
        stray = int(c.ssh(0, "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!", timeout=20).stdout)
        assert pid_alive(stray) and stray in namespace_pids(namespaces[0])
    listed_ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    listed_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    assert not any(ns in listed_ns for ns in namespaces)
    assert not any(f" {link}:" in listed_links or f" {link}@" in listed_links for link in links)
    assert not any(pid_alive(pid) for pid in sshd_pids if pid)
    assert not pid_alive(stray)
    assert not any((Path("/etc/netns") / ns).exists() for ns in namespaces)
    assert not workdir.exists()
    assert c.leftovers() == []


@pytest.mark.timeout(60)
def test_teardown_runs_when_the_test_fails() -> None:
    require_netns()
    with pytest.raises(ZeroDivisionError), netns_cluster(1) as c:
        assert c.ssh(0, "true", timeout=20).returncode == 0
        1 / 0  # noqa: B018
    assert c.leftovers() == []
    assert not any(pid_alive(n.sshd_pid) for n in c.nodes if n.sshd_pid)


@pytest.mark.timeout(60)
def test_subnets_never_overlap(netns2: NetnsCluster) -> None:
    with pytest.raises(RuntimeError, match="overlaps"):
        with netns_cluster(1, subnet=str(netns2.subnet)):
            pass
    with netns_cluster(1) as other:
        assert not other.subnet.overlaps(netns2.subnet)
        assert other.ssh(0, "hostname -I", timeout=20).stdout.split() == [other.address(0)]


@pytest.mark.timeout(60)
def test_stale_cluster_of_a_dead_owner_is_removed(netns2: NetnsCluster, tmp_path: Path) -> None:
    # A cluster whose creator died before teardown: its owner lock file exists but nobody holds the lock.
    tag = "fffffeee"
    ns, bridge, lock = f"ftk-{tag}-n0", f"ftk{tag}b", LOCK_DIR / f"ftkit-netns-{tag}.lock"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True, timeout=10)
    lock.touch()
    try:
        assert cleanup_stale() == [tag]  # netns2's cluster is alive (its owner, this process, holds its lock)
        assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        assert not Path(f"/sys/class/net/{bridge}").exists()
        assert not lock.exists()
        assert netns2.ssh(1, "true", timeout=20).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=10)
        lock.unlink(missing_ok=True)


def test_skips_with_the_reason_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="need root"):
        require_netns()


GLOO_RANK = """
import os, sys
import torch
import torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://{sys.argv[2]}:29556", rank=rank, world_size=2)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(f"rank{rank} sum={t.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_gloo_all_reduce_across_nodes_over_ssh(netns2: NetnsCluster) -> None:
    """The path real ranks take: started over ssh (sshd's bare environment), gloo bound to eth0 by name."""
    pytest.importorskip("torch")
    master = netns2.address(0)
    procs = [
        subprocess.Popen(
            netns2.ssh_argv(i, ["env", "GLOO_SOCKET_IFNAME=eth0", sys.executable, "-c", GLOO_RANK, str(i), master]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["rank0 sum=3", "rank1 sum=3"]
