"""The local tier's bookkeeping on synthetic committed parts: which parts a lost node's recovery needs (the one
copied to the next node, the ones paired with the peer copies held), bounded peer copies, and what a resume from
an earlier step discards. The real runs are in tests/integration/tiers/.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ftkit.checkpoint.layout import PEER_MARK, PEER_SENDING
from ftkit.checkpoint.tiers import (
    PEER_DIR,
    claim_peer_copy,
    clear_peer_claims,
    discard_newer,
    discard_set_records_newer,
    local_checkpoints,
    peer_claims,
    peer_parts,
    peer_protected,
    prune_set_records,
    rotate_local,
    rotate_peer_copies,
    set_records,
    write_set_record,
)
from ftkit.checkpoint.verify import verify
from tests.helpers.ckpt import commit, make_ckpt


def _tier(tmp_path: Path, steps: list[int], held: dict[str, list[int]] | None = None) -> Path:
    """A node's tier: committed own parts of ``steps``; peer copies of other nodes' parts under peer/<node>/."""
    tier = tmp_path / "node0"
    tier.mkdir()
    for step in steps:
        commit(make_ckpt(tier, step))
    for node, node_steps in (held or {}).items():
        (tier / PEER_DIR / node).mkdir(parents=True)
        for step in node_steps:
            commit(make_ckpt(tier / PEER_DIR / node, step))
    return tier


def test_rotation_keeps_the_parts_that_pair_with_peer_copies(tmp_path: Path) -> None:
    tier = _tier(tmp_path, [5, 6, 7, 8, 9], held={"node1": [6]})
    (tier / "checkpoint-5" / PEER_MARK).touch()  # node1 holds our copy of step 5
    assert peer_protected(tier) == {5, 6}
    assert verify(tier / "checkpoint-5", True).ok, "the mark is bookkeeping, not payload"
    rotate_local(tier, keep=2, durable_every=100, durable_step=None)
    assert [s for s, _, _ in local_checkpoints(tier)] == [9, 8, 6, 5]
    (tier / "checkpoint-8" / PEER_MARK).touch()  # a newer part copied: the older pairing is not needed any more
    rotate_local(tier, keep=2, durable_every=100, durable_step=None)
    assert [s for s, _, _ in local_checkpoints(tier)] == [9, 8, 6]
    # while a part is being sent, and while a copy of another node's part is arriving, the own parts stay
    for step in (10, 11, 12):
        commit(make_ckpt(tier, step))
    (tier / "checkpoint-10" / PEER_SENDING).touch()
    (tier / PEER_DIR / "node1" / ".checkpoint-11.tmp").mkdir()
    assert peer_protected(tier) == {6, 8, 10, 11}
    commit(make_ckpt(tier, 13))
    rotate_local(tier, keep=1, durable_every=100, durable_step=None)
    assert [s for s, _, _ in local_checkpoints(tier)] == [13, 11, 10, 8, 6]


def test_a_claimed_step_stays_on_the_holder_while_the_copy_is_slow_to_arrive(tmp_path: Path) -> None:
    """CI's flake of the peer-copy run: node1's copy of step N reached node0 after node0 had rotated its own part
    of step N away (an ssh connection on a loaded machine outlasts two 0.2 s steps), so no copy ever completed a
    set. The sender claims the step in the run directory before it connects; node0's rotation keeps it."""
    run = tmp_path / "run"
    tier = _tier(tmp_path, [5])
    claim_peer_copy(run, sender="node1", holder="node0", step=5)
    for step in (6, 7, 8):  # node0 saves on while node1's ssh connects
        commit(make_ckpt(tier, step))
        rotate_local(tier, keep=2, durable_every=100, durable_step=None, claimed=peer_claims(run, "node0"))
    assert [s for s, _, _ in local_checkpoints(tier)] == [8, 7, 5]
    (tier / PEER_DIR / "node1").mkdir(parents=True)
    commit(make_ckpt(tier / PEER_DIR / "node1", 5))  # the copy landed: it pairs with node0's part of step 5
    claim_peer_copy(run, sender="node1", holder="node0", step=9)  # the next copy replaces the claim
    commit(make_ckpt(tier, 9))
    rotate_local(tier, keep=2, durable_every=100, durable_step=None, claimed=peer_claims(run, "node0"))
    assert [s for s, _, _ in local_checkpoints(tier)] == [9, 8, 5]
    clear_peer_claims(run)  # a new attempt: no copy is under way
    assert peer_claims(run, "node0") == set()


def test_peer_copies_held_are_bounded_to_the_newest_committed(tmp_path: Path) -> None:
    tier = _tier(tmp_path, [9], held={"node1": [6, 7, 8]})
    arriving = tier / PEER_DIR / "node1" / ".checkpoint-9.tmp"
    arriving.mkdir()
    torn = make_ckpt(tier / PEER_DIR / "node1", 5)  # no commit record
    gone = rotate_peer_copies(tier)
    assert sorted(p.name for p in gone) == ["checkpoint-5", "checkpoint-6", "checkpoint-7"]
    assert [s for s, _ in peer_parts(tier, "node1")] == [8]
    assert arriving.is_dir() and not torn.exists()


def test_a_resume_discards_every_later_part_peer_copy_and_set_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    tier = _tier(tmp_path, [8, 11, 12], held={"node1": [11, 12]})
    for step in (8, 11, 12):
        write_set_record(run, step, attempt=0, nodes=["node0", "node1"], world_size=2, stop=None)
    gone = discard_newer(tier, 8)
    assert sorted(p.name for p in gone) == ["checkpoint-11", "checkpoint-11", "checkpoint-12", "checkpoint-12"]
    assert [s for s, _, _ in local_checkpoints(tier)] == [8] and peer_parts(tier, "node1") == []
    discard_set_records_newer(run, 8)
    assert [r["step"] for r in set_records(run)] == [8]
    discard_newer(tier, None)  # a fresh start: nothing of an earlier attempt is kept
    discard_set_records_newer(run, None)
    assert local_checkpoints(tier) == [] and set_records(run) == []
    shutil.rmtree(tier)


def test_set_records_of_peer_paired_steps_survive_pruning(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (5, 6, 7, 8, 9):
        write_set_record(run, step, attempt=0, nodes=["node0", "node1"], world_size=2, stop=None)
    prune_set_records(run, keep=2, durable_every=100, protect={6})
    assert [r["step"] for r in set_records(run)] == [9, 8, 6]
