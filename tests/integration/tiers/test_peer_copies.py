"""Issue 24 across two namespace hosts: a whole host lost with its local tier, the survivor resumes from the peer
copy it holds of the lost host's part (``checkpoint.peer_copies: 1``) or, without peer copies, from durable.

The run directory is shared (the root file system); /dev/shm is too, but each host's tier is its own directory
under it, and the test removes the lost host's directory as a reboot would. ``cluster.min_nodes: 1``: the attempt
after the loss runs on the survivor alone (a shrink), with the global batch kept, so its losses equal an
uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from ftkit.checkpoint.layout import COMMIT_FILE
from ftkit.checkpoint.tiers import peer_parts, set_records
from ftkit.rundir.layout import RunDir, read_jsonl
from tests.helpers.netns import NetnsCluster
from tests.helpers.runs import (
    RUN_ENV,
    assert_no_process_left,
    ftkit,
    local_tier_root,
    losses,
    mp_lock,
    named,
    start_ftkit,
    wait_for,
    write_recipe,
)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

ENV = {"GLOO_SOCKET_IFNAME": "eth0"}
STEPS, SAVE = 40, 20
KILL_AFTER = 24  # a step the local tier committed after the durable save at SAVE


@pytest.fixture(scope="module")
def reference(fx: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The same job uninterrupted, on one host with the same world size (2) and the same global batch."""
    d = tmp_path_factory.mktemp("peer-reference")
    recipe = write_recipe(d, fx, train__max_steps=STEPS, train__save_steps=SAVE)
    with mp_lock():
        out = ftkit("launch", str(recipe), env=RUN_ENV, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return losses(d / "run")


def _committed(run: Path, rank: int) -> int:
    for hb in RunDir(run).heartbeats():
        if hb.get("rank") == rank and hb.get("attempt") == 0 and hb.get("committed") is not None:
            return int(hb["committed"])
    return -1


def _recoverable_from_peer(run: Path, holder: str, lost: str) -> int:
    """The newest step after KILL_AFTER that ``holder`` could rebuild without ``lost``: a committed peer copy of
    ``lost``'s part, ``holder``'s own part and the set record of that step (-1: none yet). Peer copies trail the
    saves by a copy's time, so the test waits for one rather than assuming it."""
    root = local_tier_root(run)
    if root is None:
        return -1
    sets = {r["step"] for r in set_records(run)}
    for step, _ in peer_parts(root / holder, lost):
        own = root / holder / f"checkpoint-{step}" / COMMIT_FILE
        if step >= KILL_AFTER and step in sets and own.is_file():
            return step
    return -1


@pytest.mark.timeout(900)
@pytest.mark.parametrize("peer_copies", [1, 0], ids=["peer", "no-peer"])
def test_a_lost_host_and_its_tier_resume_from_the_peer_copy_else_from_durable(
    tmp_path: Path, fx: dict[str, Path], netns2: NetnsCluster, reference: dict[int, float], peer_copies: int
) -> None:
    hostfile = netns2.write_hostfile(tmp_path / "hostfile", slots=1)
    recipe = write_recipe(
        tmp_path,
        fx,
        cluster__hostfile=str(hostfile),
        cluster__ssh_config=str(netns2.ssh_config),
        cluster__master_addr=netns2.address(0),
        cluster__min_nodes=1,
        train__max_steps=STEPS,
        train__save_steps=SAVE,
        checkpoint__local_dir="auto",
        checkpoint__local_steps=1,
        checkpoint__peer_copies=peer_copies,
    )
    run = tmp_path / "run"
    with mp_lock():
        proc = start_ftkit("launch", str(recipe), env=ENV, log=tmp_path / "launch.log")
        try:
            try:
                if peer_copies:
                    usable = lambda: _recoverable_from_peer(run, "node0", "node1") > 0  # noqa: E731
                    wait_for(usable, 300, "a usable peer copy", poll=0.02, while_running=proc)
                else:
                    durable = run / f"checkpoint-{SAVE}" / COMMIT_FILE  # copied in the background: wait for it too
                    wait_for(
                        lambda: _committed(run, 1) >= KILL_AFTER and durable.is_file(),
                        300,
                        f"step {KILL_AFTER} committed locally and step {SAVE} durable",
                        poll=0.02,
                        while_running=proc,
                    )
            except AssertionError as e:  # what the copies did, for a failure on a loaded machine
                metrics = read_jsonl(RunDir(run).metrics)
                copies = [
                    (c["host"], c["step"], c["copy_s"], c["time"]) for c in metrics if c.get("event") == "peer_copy"
                ]
                log = (tmp_path / "launch.log").read_text()[-3000:]
                raise AssertionError(f"{e}\npeer copies (host, step, copy_s, time): {copies}\n{log}") from None
            newest_local = _committed(run, 1)
            netns2.kill_node(1)  # the whole host: ranks, agent, sshd; it does not come back
            root = local_tier_root(run)
            assert root is not None
            shutil.rmtree(root / "node1", ignore_errors=True)  # ... and its memory with it
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "launch.log").read_text()
    assert code == 0, log[-4000:]
    shrink = named(run, "shrink")
    assert shrink and [h for h, _ in shrink[0]["hosts"]] == ["node0"], shrink
    resumed = named(run, "launch")[1]
    if peer_copies:
        assert resumed["tier"] == "peer", resumed
        assert SAVE < resumed["step"] <= newest_local, (resumed, newest_local)
    else:
        assert resumed["tier"] == "durable", resumed
        assert resumed["step"] == SAVE, resumed
        rejected = named(run, "tier_rejected")
        assert any(e.get("node") == "node1" for e in rejected), rejected
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert abs(got[step] - loss) <= 1e-4 * max(1.0, abs(loss)), (step, got[step], loss)
    spec = json.loads((run / "ftkit/spec.json").read_text())
    assert spec["world_size"] == 1
    assert_no_process_left(run)
    root = local_tier_root(run)
    assert root is None or not root.exists(), sorted(p.name for p in root.rglob("*"))[:20]
