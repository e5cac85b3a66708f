"""ftkit at 16 hosts (issue 13): namespace hosts with sshd each, stand-in ranks that write pid records like real
ranks, and ftkit's own teardown (parallel fan-out over real ssh) killing them by pid on every host.

Needs root (network namespaces); skips with the reason otherwise. The heartbeat poll of 1,024 ranks is
tests/rundir/test_heartbeats.py.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ftkit.cluster.fanout import run_on_hosts
from ftkit.cluster.procs import targets_from_records, teardown
from ftkit.rundir.layout import RunDir
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
