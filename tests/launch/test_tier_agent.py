"""Issue 36 through the checkpoint agent's own command line (``python -m ftkit.launch.agent``, what the supervisor
runs on every host) and the supervisor's tier functions, on run directories and tiers built by hand with the real
checkpoint writers (no training):

* the end of a launch's clean-up follows no planted link (item 2) and keeps a directory ftkit did not make (item 5);
* the tier's ownership is checked again before every resume (item 1): an agent verifies nothing in a tier that is
  not this user's alone, and the supervisor starts no attempt on it;
* every step due in the run directory becomes durable at the end of a launch, or the run says it did not (item 6).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftkit.checkpoint.commit import manifest_part, write_commit
from ftkit.checkpoint.layout import COMMIT_FILE
from ftkit.checkpoint.tiers import TierUnsafe, write_set_record
from ftkit.rundir.layout import RunDir
from ftkit.rundir.spec import RunSpec
from ftkit.supervise.tier_resume import Agents, discard_stale, end_local_tier
from tests.helpers.ckpt import make_ckpt
from tests.helpers.paths import REPO
from tests.helpers.rundir import tier_run
from tests.helpers.users import other_user


def agent(rd: RunDir, command: str, *args: str) -> dict:
    """One agent command on this host, as the supervisor runs it; its one-line JSON answer."""
    out = subprocess.run(
        [sys.executable, "-m", "ftkit.launch.agent", command, str(rd.path), "--host", "localhost", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def node_part(node: Path, step: int) -> Path:
    """This node's committed part of ``step`` in its tier, as a one-node run's ranks commit it."""
    ckpt = make_ckpt(node, step)
    parts = [manifest_part(ckpt, r, 2) for r in range(2)]
    extra = {"attempt": 0, "tier": "local", "node": "localhost", "nodes": ["localhost"], "ranks": [0, 1]}
    write_commit(ckpt, parts, step=step, world_size=2, stage=2, recipe_hash="abc123", extra=extra)
    return ckpt


class Said(list):
    def __call__(self, event: str, message: str | None = None, /, **data: object) -> None:
        self.append({"event": event, "message": message, **data})


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path("/dev/shm") / f"ftkit-test36-{secrets.token_hex(4)}"
    yield root
    if root.is_symlink():
        root.unlink()
    elif root.exists():
        shutil.rmtree(root)


def test_the_clean_up_follows_no_link_planted_at_the_tier_path(shm_root: Path, tmp_path: Path) -> None:
    """Item 2: another user's link at /dev/shm/ftkit-<name>-<hash>: the end of the launch removed <target>/localhost."""
    victim = tmp_path / "victim"
    (victim / "localhost").mkdir(parents=True)
    (victim / "localhost" / "thesis.tex").write_text("years of work\n")
    rd = tier_run(tmp_path / "run", f"{shm_root}/{{host}}", ["localhost"])
    with other_user() as mallory:
        mallory.run("ln", "-s", str(victim), str(shm_root), check=True)
        answer = agent(rd, "clean")
    assert (victim / "localhost" / "thesis.tex").read_text() == "years of work\n", answer
    assert answer["ok"] is False and answer["unsafe"] and "a symbolic link" in answer["reason"], answer


def test_the_clean_up_keeps_a_directory_ftkit_did_not_make(tmp_path: Path) -> None:
    """Item 5: ``checkpoint.local_dir: /scratch/me/{host}``: the empty /scratch/me was removed at the end."""
    me = tmp_path / "scratch" / "me"
    me.mkdir(parents=True)
    rd = tier_run(tmp_path / "run", f"{me}/{{host}}", ["localhost"])
    assert agent(rd, "clean", "--newer-than", "-1")["ok"]  # before the first attempt: the tier is made
    node = me / "localhost"
    node.mkdir(exist_ok=True)  # (what the ranks do if nobody did)
    node_part(node, 5)
    answer = agent(rd, "clean")
    assert answer["ok"] and not node.exists(), answer
    assert me.is_dir(), "the user's own /scratch/me was removed"


def test_the_tiers_ownership_is_checked_again_before_every_resume(tmp_path: Path) -> None:
    """Item 1: the relaunch said "commit verified on every node" of a tier another user controlled. A node's
    agent verifies nothing in a tier that is not this user's alone, and the supervisor starts no attempt on it."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    rd = tier_run(tmp_path / "run", f"{shm}/ftkit-x/{{host}}", ["localhost"])
    assert agent(rd, "clean", "--newer-than", "-1")["ok"]
    node = shm / "ftkit-x" / "localhost"
    node.mkdir(parents=True, exist_ok=True)
    node_part(node, 3)
    write_set_record(rd.path, 3, attempt=0, nodes=["localhost"], world_size=2, stop=None)
    assert agent(rd, "verify", "--step", "3")["ok"]
    with other_user() as mallory:
        os.chown(node, mallory.uid, mallory.gid)  # between two attempts, the node's tier became another user's
        answer = agent(rd, "verify", "--step", "3")
        assert answer["ok"] is False and answer.get("unsafe"), answer
        assert f"owned by uid {mallory.uid}, not by this user" in answer["reason"], answer
        said = Said()
        with pytest.raises(TierUnsafe, match=f"the local checkpoint tier on localhost: {node}: owned by uid"):
            discard_stale(rd, ["localhost"], 3, Agents(rd, sys.executable, []), said)
        assert [e["event"] for e in said] == ["refused"] and said[0]["kind"] == "tier_unsafe"
        assert (node / "checkpoint-3" / COMMIT_FILE).is_file()  # nothing removed from it either
        os.chown(node, 0, 0)


def test_every_due_step_becomes_durable_at_the_end_of_a_launch_or_the_run_says_not(tmp_path: Path) -> None:
    """Item 6: the background copier lagged; the end of the launch copied only the newest uncopied step and removed
    the tier holding the others (save every 5 of 12 steps: checkpoint-5 and -12 kept, -10 never durable)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    rd = tier_run(tmp_path / "run", f"{shm}/ftkit-x/{{host}}", ["localhost"], durable_steps=5)
    tier = RunSpec.read(rd.spec).local_tier
    assert tier is not None
    assert agent(rd, "clean", "--newer-than", "-1")["ok"]
    node = shm / "ftkit-x" / "localhost"
    node.mkdir(parents=True, exist_ok=True)
    for step in (5, 10, 12, 15, 17):
        node_part(node, step)
        write_set_record(rd.path, step, attempt=0, nodes=["localhost"], world_size=2, stop=None)
    assert agent(rd, "flush", "--step", "5")["published"]  # the copier made 5 durable, then lagged
    (node / "checkpoint-15" / "model.safetensors").unlink()  # 15's part torn: it cannot be made durable
    said = Said()
    end_local_tier(rd, tier, ["localhost"], Agents(rd, sys.executable, []), said)
    durable = sorted(int(p.name.split("-")[1]) for p in rd.path.glob("checkpoint-*") if (p / COMMIT_FILE).is_file())
    assert durable == [5, 10, 17], said  # every due one, and the newest (12 is neither: 17 supersedes it)
    failed = [e for e in said if e["event"] == "tier_flush_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 15, said
    assert "step 15 (due in the run directory: train.save_steps) was never made durable" in failed[0]["message"]
    assert not (shm / "ftkit-x").exists() and shm.is_dir()  # the tier went, what held it stayed


def test_ranks_that_finish_without_their_supervisor_end_their_nodes_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 13: an orphan-finished run (supervisor SIGKILLed, its ranks finish) left its tier in /dev/shm, tens of
    GB per node on a real model. At its exit the node's first rank copies what the end of a launch would (here step
    5, due, and step 7, the newest) and removes the tier (the rank's own method, as ``ftkit.hf`` calls it)."""
    from ftkit.launch.rank import RankContext
    from ftkit.launch.tier import NodeTier

    shm = tmp_path / "shm"
    shm.mkdir()
    rd = tier_run(tmp_path / "run", f"{shm}/ftkit-x/{{host}}", ["localhost"], durable_steps=5)
    spec = RunSpec.read(rd.spec)
    assert agent(rd, "clean", "--newer-than", "-1")["ok"]
    node = shm / "ftkit-x" / "localhost"
    for step in (4, 5, 6, 7):
        node_part(node, step)
        write_set_record(rd.path, step, attempt=0, nodes=["localhost"], world_size=2, stop=None)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "FTKIT_NODE": "localhost"}.items():
        monkeypatch.setenv(name, value)
    assert spec.local_tier is not None
    NodeTier(spec.local_tier, "localhost").end_orphaned(RankContext(rd.path, 0, spec), spec)
    durable = sorted(int(p.name.split("-")[1]) for p in rd.path.glob("checkpoint-*") if (p / COMMIT_FILE).is_file())
    assert durable == [5, 7] and not (shm / "ftkit-x").exists() and shm.is_dir()
