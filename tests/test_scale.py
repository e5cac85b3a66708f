"""ftkit at 16 hosts (issue 13): namespace hosts with sshd each, stand-in ranks that write pid records like real
ranks, and ftkit's own teardown (parallel fan-out over real ssh) killing them by pid on every host.

Needs root (network namespaces); skips with the reason otherwise. Also: a quick bound on the supervisor's
heartbeat poll with 1,024 rank heartbeat files.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from ftkit.cluster.fanout import run_on_hosts
from ftkit.cluster.procs import targets_from_records, teardown
from ftkit.rundir.layout import RunDir, atomic_write
from tests.helpers.netns import netns_cluster, require_netns, start_standins
from tests.helpers.runs import mp_lock

N_HOSTS = 16


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.timeout(300)  # the cluster, stand-ins and teardown take ~10 s; the rest is waiting for mp_lock
def test_teardown_of_16_hosts_leaves_nothing(tmp_path: Path) -> None:
    """Every rank and agent on every host is gone after one teardown, checked by pid on each host over ssh; the
    teardown spends the grace period once for all hosts (old code: 3 ssh sessions per host, one after another)."""
    require_netns()
    with mp_lock(), netns_cluster(N_HOSTS, workdir=tmp_path / "netns", skip_bashrc=True) as cluster:
        print(f"cluster of {N_HOSTS} up")
        run_dir = tmp_path / "run"
        # Local rank 1 of every node ignores SIGTERM (a rank stuck in a collective): it needs the SIGKILL.
        standins = start_standins(cluster, run_dir, ranks_per_node=2, modes=("exit", "ignore"))
        try:
            t_start = time.monotonic()
            records = standins.wait_ready(timeout=60)
            print(f"stand-ins ready in {time.monotonic() - t_start:.1f}s")
            assert sorted({r["host"] for r in records}) == sorted(cluster.aliases)
            frozen = next(r for r in records if r["host"] == "node3" and r["local_rank"] == 0)
            os.kill(frozen["pid"], signal.SIGSTOP)  # acts on SIGTERM only once continued
            targets = targets_from_records(RunDir(run_dir).records("pids", 0))
            assert len({(t.host, t.pid) for t in targets}) == 3 * N_HOSTS  # two ranks and their agent per host
            ssh_args = ["-F", str(cluster.ssh_config)]
            grace = 2.0
            t0 = time.monotonic()
            res = teardown([], targets, grace_s=grace, ssh_args=ssh_args, ssh_timeout=10)
            took = time.monotonic() - t0
            print(f"teardown of {N_HOSTS} hosts: {took:.2f}s")
            assert res.clean, res.as_dict()
            assert len(res.signalled) == 3 * N_HOSTS
            ignoring = sorted(f"{r['host']}:{r['pid']}" for r in records if r["local_rank"] == 1)
            assert sorted(res.killed) == ignoring
            # grace once, plus ssh and the verify; sequential per-host sessions took ~16 × 3 round trips + grace
            assert took < grace + 4, took
            # By pid, on each host, through its own sshd: nothing of the run is left.
            by_host: dict[str, list[int]] = {}
            for r in records:
                by_host.setdefault(r["host"], []).extend([r["pid"], r["ppid"]])
            look = run_on_hosts(
                list(by_host),
                lambda h: (
                    "for p in " + " ".join(map(str, by_host[h])) + '; do [ -e /proc/$p ] && echo "$p"; done; true'
                ),
                ssh_args,
                deadline_s=20,
            )
            assert {h: (r.reachable, r.out) for h, r in look.items()} == {h: (True, "") for h in by_host}
            assert standins.wait_gone(10) == []  # each node's reaper saw all of its descendants go
        finally:
            standins.kill()


def _beat(rd: RunDir, rank: int, step: int) -> None:
    rec = {"rank": rank, "attempt": 0, "phase": "train", "step": step, "time": time.time(), "node": f"node{rank // 8}"}
    atomic_write(rd.heartbeat(rank), json.dumps(rec), fsync=False)  # as ranks write it


def test_heartbeat_poll_of_1024_ranks_is_cheap(tmp_path: Path) -> None:
    """The supervisor reads every heartbeat once per poll (every 0.5 s). Reading and parsing 1,024 files took
    ~30-55 ms per poll even when nothing had changed; unchanged files are now only stat'ed (target < 50 ms per
    poll in any case; bounded loosely here, the machine is shared). Changes are still all seen."""
    writer, rd = RunDir(tmp_path), RunDir(tmp_path)
    for rank in range(1024):
        _beat(writer, rank, 7)
    assert [h["rank"] for h in rd.heartbeats()] == sorted(range(1024), key=lambda r: f"rank-{r}.json")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        hbs = rd.heartbeats()
        times.append(time.perf_counter() - t0)
    assert len(hbs) == 1024 and {h["step"] for h in hbs} == {7}
    assert min(times) < 0.02, times
    # every kind of change shows at the next poll
    _beat(writer, 5, 8)
    writer.heartbeat(6).unlink()
    writer.heartbeat(7).write_text("{torn")
    hbs[0]["step"] = "changed by a caller"
    polled = {h["rank"]: h["step"] for h in rd.heartbeats()}
    assert polled[5] == 8 and 6 not in polled and 7 not in polled and polled[0] == 7
    _beat(writer, 7, 9)
    assert {h["rank"]: h["step"] for h in rd.heartbeats()}[7] == 9
    assert RunDir(tmp_path / "none").heartbeats() == []
