"""Commit records, verification, resume selection and rotation on synthetic HF Trainer + DeepSpeed trees.

The trees mimic what ``Trainer._save_checkpoint`` + DeepSpeed write (file names, per-rank files, ``latest``),
with small fake payloads, so every test runs in milliseconds and no torch is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.checkpoint import directory as ck
from ftkit.checkpoint.checksums import DEFAULT_SPEC, SampleSpec, blake2b_checksum, full_checksum, sampled_checksum
from ftkit.checkpoint.commit import CommitError, manifest_part, write_commit
from ftkit.checkpoint.directory import list_checkpoints, list_set_aside, rotate, select_resume, set_aside_newer
from ftkit.checkpoint.layout import COMMIT_FILE, SAVES_DIR, files_owned_by_rank, model_weights, reshards
from ftkit.checkpoint.verify import VerdictKind, verify
from tests.helpers.ckpt import MiB, commit, flip_byte, make_ckpt, make_dcp_ckpt

# ---------------------------------------------------------------------------------------------- commit


def test_commit_round_trip(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    record_path = commit(ckpt)
    record = json.loads(record_path.read_text())
    assert record["format"] == "ftkit-checkpoint-commit" and record["version"] == 2
    assert (record["step"], record["world_size"], record["stage"], record["recipe_hash"]) == (30, 2, 2, "abc123")
    assert record["tag"] == "global_step30"
    assert record["checksum"] == {"mode": "full", "name": "xxh3_128"}
    assert all(e["checksum"].startswith("xxh3_128:") and len(e["checksum"]) == 9 + 32 for e in record["files"].values())
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != COMMIT_FILE)
    assert sorted(record["files"]) == on_disk
    shard1 = record["files"]["global_step30/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert shard1["rank"] == 1 and shard1["size"] == 701
    assert record["files"]["rng_state_1.pth"]["rank"] == 1
    assert record["files"]["global_step30/mp_rank_00_model_states.pt"]["rank"] == 0

    for checksums in (False, True):
        v = verify(ckpt, checksums=checksums)
        assert (v.ok, v.committed, v.kind, v.step) == (True, True, VerdictKind.OK, 30), v.reason
    assert verify(ckpt, checksums=True).reason.endswith("files verified (sizes+checksums)")


def test_stage3_and_single_process_layouts_commit(tmp_path: Path) -> None:
    z3 = make_ckpt(tmp_path, 10, world_size=4, stage=3)
    commit(z3, world_size=4, stage=3)
    assert verify(z3, world_size=4, stage=3).ok
    assert files_owned_by_rank(z3, 3, 4) == [
        "global_step10/bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt",
        "global_step10/zero_pp_rank_3_mp_rank_00_model_states.pt",
        "rng_state_3.pth",
    ]
    single = make_ckpt(tmp_path, 20, world_size=1, stage=0, bf16=False)  # stage 0 fp32: no optim shards at all
    commit(single, world_size=1, stage=0)
    assert verify(single, world_size=1, stage=0).ok


def test_ownership_follows_the_writer(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 5)
    (ckpt / "global_step5/offloaded_tensors/rank01").mkdir(parents=True)
    (ckpt / "global_step5/offloaded_tensors/rank01/swap.tensor").write_bytes(b"x")
    owned0 = files_owned_by_rank(ckpt, 0, 2)
    owned1 = files_owned_by_rank(ckpt, 1, 2)
    assert "global_step5/mp_rank_00_model_states.pt" in owned0  # mp_rank_00 is not a rank-0 marker by accident
    assert "trainer_state.json" in owned0 and "latest" in owned0
    assert set(owned1) == {
        "global_step5/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "rng_state_1.pth",
        "global_step5/offloaded_tensors/rank01/swap.tensor",
    }
    assert not set(owned0) & set(owned1)
    with pytest.raises(ValueError):
        files_owned_by_rank(ckpt, 2, 2)


def test_tensor_parallel_shards_belong_to_their_global_rank_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    """DeepSpeed AutoTP (a 2-rank tp=2 run and a 4-rank tp=2 x dp=2 one) names each TP rank's shards mp_rank_{mp}:
    the old check read both optimizer shards of a tp=2 run as rank 0's ('optimizer shards for ranks [0, 0]') and
    refused every save of it."""
    ckpt = make_ckpt(tmp_path / "tp2", 4, tp=2)
    commit(ckpt)
    assert verify(ckpt, world_size=2, stage=2, checksums=True).ok
    assert files_owned_by_rank(ckpt, 1, 2) == [
        "global_step4/bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "global_step4/mp_rank_01_model_states.pt",
        "rng_state_1.pth",
    ]
    grid = make_ckpt(tmp_path / "tp2dp2", 8, world_size=4, tp=2)
    commit(grid, world_size=4)
    assert [sorted(files_owned_by_rank(grid, r, 4))[0] for r in range(4)] == [
        "config.json",
        "global_step8/bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "global_step8/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "global_step8/bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt",
    ]
    (grid / COMMIT_FILE).unlink()
    model1 = grid / "global_step8/mp_rank_01_model_states.pt"
    payload = model1.read_bytes()
    model1.unlink()
    with pytest.raises(CommitError, match=r"tensor-parallel shards of 2 ranks but no model states of mp rank 1"):
        commit(grid, world_size=4)
    model1.write_bytes(payload)
    (grid / "global_step8/bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    assert "optimizer shards for ranks [0, 2, 3]" in (verify(grid, require_commit=False).reason or "")


def test_write_commit_refuses_uncovered_file(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    only_rank0 = [manifest_part(ckpt, 0, 2)]
    with pytest.raises(CommitError, match=r"not covered.*bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt \(rank 1\)"):
        write_commit(ckpt, only_rank0, step=30, world_size=2, stage=2, recipe_hash="h")
    assert not (ckpt / COMMIT_FILE).exists()

    # A stale shard of a rank that does not exist in this world size belongs to nobody: refuse.
    (ckpt / "global_step30/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"old")
    with pytest.raises(CommitError, match=r"zero_pp_rank_2.*\(rank 2\)"):
        commit(ckpt)
    assert not (ckpt / COMMIT_FILE).exists()


def test_write_commit_refuses_files_that_changed_or_vanished(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    parts = [manifest_part(ckpt, r, 2) for r in range(2)]
    with open(ckpt / "rng_state_1.pth", "ab") as f:  # rank 1 still writing: the caller's barrier was missing
        f.write(b"more")
    with pytest.raises(CommitError, match=r"rng_state_1\.pth is 94 bytes, rank 1 measured 90"):
        write_commit(ckpt, parts, step=30, world_size=2, stage=2, recipe_hash="h")
    (ckpt / "rng_state_1.pth").unlink()
    with pytest.raises(CommitError, match=r"rng_state_1\.pth is in rank 1's manifest but does not exist"):
        write_commit(ckpt, parts, step=30, world_size=2, stage=2, recipe_hash="h")


def test_write_commit_refuses_structurally_broken_checkpoint(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    (ckpt / "trainer_state.json").unlink()
    with pytest.raises(CommitError, match=r"^checkpoint-30: trainer_state\.json missing$"):
        commit(ckpt)
    ckpt2 = make_ckpt(tmp_path, 40)
    with pytest.raises(
        CommitError, match=r"optimizer shards for 2 ranks, world size is 4"
    ):  # 2 optimizer shards on disk, caller claims 4 ranks
        parts = [manifest_part(ckpt2, r, 4) for r in range(4)]
        write_commit(ckpt2, parts, step=40, world_size=4, stage=2, recipe_hash="h")


def test_atomic_write_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    stale = ckpt / f".{COMMIT_FILE}.tmp-999-dead"  # left by a write_commit that crashed before its rename
    stale.write_text("{partial")
    commit(ckpt)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".")) == []
    assert verify(ckpt).ok

    # A crash at the rename leaves neither a record nor a temp file; the checkpoint stays uncommitted.
    ckpt2 = make_ckpt(tmp_path, 40)

    def boom(src: object, dst: object) -> None:
        raise OSError("simulated crash")

    monkeypatch.setattr(ck.os, "replace", boom)
    with pytest.raises(OSError, match="simulated crash"):
        commit(ckpt2)
    assert [p.name for p in ckpt2.iterdir() if "ftkit_commit" in p.name] == []
    assert verify(ckpt2).kind == VerdictKind.NO_COMMIT


# ---------------------------------------------------------------------------------------------- verify


def test_truncated_shard_detected_by_size(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    commit(ckpt)
    shard = ckpt / "global_step30/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(shard, 123)
    v = verify(ckpt)
    assert (v.ok, v.committed, v.kind) == (False, True, VerdictKind.TORN)
    assert v.reason == (
        "checkpoint-30: global_step30/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is 123 bytes, "
        "commit record says 701"
    )
    shard.unlink()
    assert verify(ckpt).reason.endswith("optim_states.pt is listed in the commit record but missing")


def test_modified_byte_in_small_file_detected_by_checksum(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    commit(ckpt)
    flip_byte(ckpt / "scheduler.pt", 40)
    assert verify(ckpt, checksums=False).ok  # same size: sizes alone cannot see it
    v = verify(ckpt)
    assert (v.ok, v.kind) == (False, VerdictKind.TORN)
    assert v.reason.startswith("checkpoint-30: scheduler.pt checksum xxh3_128:")


def test_flipped_block_mid_shard_rejected_by_default(tmp_path: Path) -> None:
    """The observed failure: 16 bytes flipped mid-file in a large optimizer shard, size unchanged, resumed as
    "commit verified" and trained to losses of 0.0. With default arguments everywhere it must be rejected."""
    commit(make_ckpt(tmp_path, 10))
    ckpt = make_ckpt(tmp_path, 20, optim_bytes=12 * MiB)  # > 8 MiB: the sampled digest would skip its middle
    commit(ckpt)  # what launch/train.py does: manifest_part and write_commit with their defaults
    shard = ckpt / "global_step20/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    for i in range(16):
        flip_byte(shard, size // 2 + 4321 + i)
    assert shard.stat().st_size == size
    v = verify(ckpt)
    assert (v.ok, v.committed, v.kind) == (False, True, VerdictKind.TORN), v.reason
    assert v.reason.startswith("checkpoint-20: global_step20/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt checksum")
    sel = select_resume(tmp_path)
    assert (sel.step, [(r.path.name if r.path else None, r.kind) for r in sel.rejected]) == (
        10,
        [("checkpoint-20", VerdictKind.TORN)],
    )


def test_old_blake2b_records_still_verify(tmp_path: Path) -> None:
    """Runs committed by commit-record version 1 (blake2b full and sampled digests) keep resuming."""
    ckpt = make_ckpt(tmp_path, 30, model_bytes=9 * MiB)
    commit(ckpt)
    record = json.loads((ckpt / COMMIT_FILE).read_text())
    record["version"] = 1
    record["checksum"] = DEFAULT_SPEC.to_json()  # version 1 always stored the sampling parameters
    for rel, entry in record["files"].items():
        path = ckpt / rel
        entry["checksum"] = sampled_checksum(path) if rel == "model.safetensors" else blake2b_checksum(path)
        if rel == "model.safetensors":
            assert entry["checksum"].startswith("blake2b-sampled:")
    (ckpt / COMMIT_FILE).write_text(json.dumps(record))
    v = verify(ckpt)
    assert v.ok and v.reason.endswith("(sizes+checksums)"), v.reason
    flip_byte(ckpt / "scheduler.pt", 3)
    assert verify(ckpt).reason.startswith("checkpoint-30: scheduler.pt checksum blake2b:")


def test_unknown_checksum_algorithm_and_mode(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    commit(ckpt)
    record = json.loads((ckpt / COMMIT_FILE).read_text())
    record["files"]["scheduler.pt"]["checksum"] = "md7:00"
    (ckpt / COMMIT_FILE).write_text(json.dumps(record))
    v = verify(ckpt, checksums=False)  # a record this version cannot check is bad even for a sizes-only look
    assert (v.ok, v.kind) == (False, VerdictKind.BAD_COMMIT) and "unknown checksum algorithm 'md7'" in v.reason
    with pytest.raises(ValueError, match="checksum must be one of full, sampled"):
        manifest_part(ckpt, 0, 2, checksum="fast")


def test_unreadable_file_rejects_instead_of_raising(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    commit(ckpt)
    (ckpt / "scheduler.pt").unlink()
    os.symlink("scheduler.pt", ckpt / "scheduler.pt")  # a symlink loop: stat raises ELOOP
    for checksums in (False, True):
        v = verify(ckpt, checksums)
        assert (v.ok, v.kind) == (False, VerdictKind.TORN)
        assert v.reason.startswith("checkpoint-30: cannot read scheduler.pt ("), v.reason


@pytest.mark.parametrize("where", ["head", "tail", "window"])
def test_sampled_region_corruption_in_large_file(tmp_path: Path, where: str) -> None:
    size = 9 * MiB  # above the default 8 MiB small-file limit: hashed by sampling
    ckpt = make_ckpt(tmp_path, 30, model_bytes=size)
    commit(ckpt, checksum="sampled")  # the explicit opt-in (resilience.checksum: sampled)
    record = json.loads((ckpt / COMMIT_FILE).read_text())
    assert record["checksum"] == {"mode": "sampled", **DEFAULT_SPEC.to_json()}
    entry = record["files"]["model.safetensors"]
    assert entry["checksum"].startswith("blake2b-sampled:")
    assert record["files"]["scheduler.pt"]["checksum"].startswith("xxh3_128:")  # small files: every byte
    spec = DEFAULT_SPEC
    last = size - spec.block_bytes
    offset = {"head": 7, "tail": size - 1, "window": last * 5 // (spec.blocks + 1) + 1000}[where]
    flip_byte(ckpt / "model.safetensors", offset)
    assert verify(ckpt, checksums=False).ok
    v = verify(ckpt)
    assert not v.ok and v.reason.startswith("checkpoint-30: model.safetensors checksum")


def test_sampled_checksum_documented_blind_spot_and_full_checksum(tmp_path: Path) -> None:
    spec = SampleSpec(small_file_bytes=64 * 1024, blocks=2, block_bytes=4096)
    path = tmp_path / "shard.bin"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB; windows at 0, ~1/3, ~2/3 and the tail
    fast, full, b2 = sampled_checksum(path, spec), full_checksum(path), blake2b_checksum(path)
    flip_byte(path, 200_000)  # between windows: the sampled digest does not see it (documented), the full one does
    assert sampled_checksum(path, spec) == fast
    assert full_checksum(path) != full and blake2b_checksum(path) != b2
    os.truncate(path, 1024 * 1024 - 1)  # truncation changes the sampled digest too (size is hashed)
    assert sampled_checksum(path, spec) != fast
    small = tmp_path / "small.json"
    small.write_text("{}")
    assert sampled_checksum(small) == full_checksum(small) and full_checksum(small).startswith("xxh3_128:")


def test_default_commit_uses_full_checksums(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30, model_bytes=9 * MiB)
    parts = [manifest_part(ckpt, r, 2) for r in range(2)]
    write_commit(ckpt, parts, step=30, world_size=2, stage=2, recipe_hash="h")
    flip_byte(ckpt / "model.safetensors", 4 * MiB + 12345)  # outside every sampled window
    assert not verify(ckpt).ok


def test_an_accelerate_state_saved_by_every_rank_as_process_0_is_not_committed(tmp_path: Path) -> None:
    """Two ranks whose Accelerator each believed it was the only process write the same files (random_states_0.pkl
    only): the commit names the cause instead of committing one rank's state, or racing on its sizes."""
    ckpt = tmp_path / "checkpoint-8"
    ckpt.mkdir()
    for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl"):
        (ckpt / name).write_bytes(b"x" * 64)
    parts = [manifest_part(ckpt, r, 2) for r in range(2)]
    with pytest.raises(CommitError, match=r"checkpoint-8: Accelerate saved the state of process\(es\) 0 for world "):
        write_commit(ckpt, parts, step=8, world_size=2, stage=None, recipe_hash="h", kind="state")
    (ckpt / "random_states_1.pkl").write_bytes(b"y" * 64)
    parts = [manifest_part(ckpt, r, 2) for r in range(2)]
    write_commit(ckpt, parts, step=8, world_size=2, stage=None, recipe_hash="h", kind="state")
    assert verify(ckpt).ok


def test_missing_trainer_state(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    (ckpt / "trainer_state.json").unlink()
    v = verify(ckpt, require_commit=False)
    assert (v.ok, v.kind, v.reason) == (False, VerdictKind.STRUCTURE, "checkpoint-30: trainer_state.json missing")
    (ckpt / "trainer_state.json").write_text('{"global_st')
    assert "trainer_state.json does not parse" in verify(ckpt, require_commit=False).reason


def test_latest_points_to_missing_tag(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    (ckpt / "latest").write_text("global_step40")
    v = verify(ckpt, require_commit=False)
    assert (v.ok, v.reason) == (False, "checkpoint-30: `latest` names global_step40 which does not exist")

    committed = make_ckpt(tmp_path, 50)
    commit(committed)
    (committed / "latest").write_text("global_step51")  # same size, so only the tag check can catch it
    v = verify(committed)
    assert (v.ok, v.committed, v.reason) == (
        False,
        True,
        "checkpoint-50: `latest` names global_step51 which does not exist",
    )


def test_uncommitted_rejected_under_require_commit_and_structural_otherwise(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 40)
    v = verify(ckpt)
    assert (v.ok, v.committed, v.kind) == (False, False, VerdictKind.NO_COMMIT)
    # True both for ftkit's own save killed before its commit and for a checkpoint written without ftkit.
    assert v.reason == (
        "checkpoint-40: no commit record: the save did not finish "
        "(files look complete; killed before ftkit's commit, or not written by ftkit)"
    )
    v = verify(ckpt, require_commit=False)
    assert (v.ok, v.committed, v.kind) == (True, False, VerdictKind.OK)
    (ckpt / "rng_state_1.pth").unlink()  # killed mid-save: the structural problem is the reason given
    v = verify(ckpt)
    assert v.kind == VerdictKind.NO_COMMIT
    assert v.reason.startswith("checkpoint-40: no commit record: the save did not finish (rng_state_1.pth missing")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda c: (c / "rng_state_1.pth").unlink(), "rng_state_1.pth missing"),
        (lambda c: (c / "latest").unlink(), "global_step30/ exists but `latest` is missing"),
        (lambda c: (c / "scheduler.pt").write_bytes(b""), "scheduler.pt is empty (0 bytes)"),
        (lambda c: [p.unlink() for p in c.glob("global_step30/*optim_states.pt")], "has no *optim_states.pt"),
        (lambda c: (c / "global_step30/mp_rank_00_model_states.pt").unlink(), "has no *model_states.pt"),
        (
            lambda c: (c / "global_step30/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink(),
            "optimizer shards for ranks [1], expected 0..0",
        ),
        (
            lambda c: (c / "trainer_state.json").write_text('{"global_step": 29}'),
            "trainer_state.json says global_step 29, expected 30",
        ),
    ],
)
def test_structural_check_rejects_torn_layouts(tmp_path: Path, damage: object, reason: str) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    assert verify(ckpt, require_commit=False).ok
    damage(ckpt)  # type: ignore[operator]
    v = verify(ckpt, require_commit=False)
    assert not v.ok and v.kind == VerdictKind.STRUCTURE
    assert reason in v.reason, v.reason


def test_bad_commit_record(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 30)
    (ckpt / COMMIT_FILE).write_text("{not json")
    v = verify(ckpt)
    assert (v.ok, v.committed, v.kind) == (False, True, VerdictKind.BAD_COMMIT)
    commit(ckpt)
    record = json.loads((ckpt / COMMIT_FILE).read_text())
    record["version"] = 99
    (ckpt / COMMIT_FILE).write_text(json.dumps(record))
    assert "version 99 is newer than supported" in verify(ckpt).reason


def test_a_commit_record_of_another_step_or_naming_a_path_outside_is_rejected(tmp_path: Path) -> None:
    """A commit record copied from checkpoint-20 into checkpoint-30 (same files, same sizes) does not vouch for
    step 30; a record whose file list reaches outside its checkpoint is not followed there (issue 41's mutation
    check: dropping either check passed every fast test)."""
    ckpt20, ckpt30 = make_ckpt(tmp_path, 20), make_ckpt(tmp_path, 30)
    commit(ckpt20)
    shutil.copy(ckpt20 / COMMIT_FILE, ckpt30 / COMMIT_FILE)
    v = verify(ckpt30)
    assert (v.ok, v.committed, v.kind, v.step) == (False, True, VerdictKind.BAD_COMMIT, 30), v
    assert "commit record is for step 20" in v.reason

    commit(ckpt30)
    (tmp_path / "outside.bin").write_bytes(b"x" * 7)
    record = json.loads((ckpt30 / COMMIT_FILE).read_text())
    record["files"]["../outside.bin"] = {**next(iter(record["files"].values())), "size": 7}
    (ckpt30 / COMMIT_FILE).write_text(json.dumps(record))
    v = verify(ckpt30, checksums=False)
    assert (v.ok, v.kind) == (False, VerdictKind.BAD_COMMIT), v
    assert "commit record lists a path outside the checkpoint: ../outside.bin" in v.reason


# ---------------------------------------------------------------------------------------------- selection


def test_list_checkpoints_ignores_other_entries(tmp_path: Path) -> None:
    for name in ["checkpoint-5", "checkpoint-40", "checkpoint-100", "checkpoint-x", ".deleting-checkpoint-7-1-aa"]:
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-20.rejected-20250101T000000Z-ab").mkdir()
    (tmp_path / "checkpoint-9").write_text("a file, not a directory")
    assert [(s, p.name) for s, p in list_checkpoints(tmp_path)] == [
        (100, "checkpoint-100"),
        (40, "checkpoint-40"),
        (5, "checkpoint-5"),
    ]
    assert list_checkpoints(tmp_path / "missing") == []


def test_select_resume_picks_newest_valid_and_reports_newer_rejects(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        commit(make_ckpt(tmp_path, step))
    os.truncate(tmp_path / "checkpoint-30/global_step30/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", 5)
    make_ckpt(tmp_path, 40)  # torn by a crash before commit

    sel = select_resume(tmp_path, world_size=2, stage=2)
    assert (sel.chosen, sel.step) == (tmp_path / "checkpoint-20", 20)
    assert sel.verdict is not None and sel.verdict.committed
    assert [(v.path.name if v.path else None, v.kind) for v in sel.rejected] == [
        ("checkpoint-40", VerdictKind.NO_COMMIT),
        ("checkpoint-30", VerdictKind.TORN),
    ]
    assert sel.rejected_reasons[1][1].startswith("checkpoint-30: global_step30/bf16_zero_pp_rank_0")
    assert sel.incompatible == []

    # Without require_commit the structurally complete checkpoint-40 is taken (plain HF runs).
    assert select_resume(tmp_path, require_commit=False).step == 40
    assert select_resume(tmp_path / "fresh").chosen is None


def test_world_size_and_stage_mismatch_are_distinct_kinds(tmp_path: Path) -> None:
    commit(make_ckpt(tmp_path, 10))
    commit(make_ckpt(tmp_path, 20))
    sel = select_resume(tmp_path, world_size=4, stage=2)
    assert sel.chosen is None
    assert [v.kind for v in sel.rejected] == [VerdictKind.WORLD_SIZE_MISMATCH] * 2
    assert len(sel.incompatible) == 2
    assert "committed with world size 2, this launch has 4" in sel.rejected[0].reason

    v = verify(tmp_path / "checkpoint-20", stage=3, world_size=2)
    assert (v.kind, v.incompatible) == (VerdictKind.STAGE_MISMATCH, True)

    # Integrity first: a torn checkpoint with another world size is torn, not "incompatible".
    os.truncate(tmp_path / "checkpoint-20/scheduler.pt", 1)
    assert verify(tmp_path / "checkpoint-20", world_size=4).kind == VerdictKind.TORN

    # Uncommitted DeepSpeed checkpoints: the world size is read off the optimizer shards.
    make_ckpt(tmp_path, 30, world_size=2)
    v = verify(tmp_path / "checkpoint-30", require_commit=False, world_size=3)
    assert v.kind == VerdictKind.WORLD_SIZE_MISMATCH and "saved by 2 ranks" in v.reason


def test_fsdp2_dcp_shards_belong_to_their_rank_and_verify_on_any_world_size(tmp_path: Path) -> None:
    """FSDP2's DCP checkpoints: each rank checksums its own ``__R_0.distcp`` (rank 0 the ``.metadata``); committed,
    they verify on another world size and either FSDP2 resharding choice (DCP reshards on load: no conversion)."""
    ckpt = make_dcp_ckpt(tmp_path, 8)
    assert files_owned_by_rank(ckpt, 1, 2) == [
        "optimizer_0/__1_0.distcp",
        "pytorch_model_fsdp_0/__1_0.distcp",
        "rng_state_1.pth",
    ]
    assert "pytorch_model_fsdp_0/.metadata" in files_owned_by_rank(ckpt, 0, 2)
    commit(ckpt, stage=3)
    assert reshards(json.loads((ckpt / COMMIT_FILE).read_text())["files"])
    for world_size, stage in ((1, 3), (4, 2), (2, 3)):
        v = verify(ckpt, world_size=world_size, stage=stage)
        assert v.ok and v.kind == VerdictKind.OK, (world_size, stage, v.reason)
    sel = select_resume(tmp_path, world_size=1, stage=3)
    assert sel.chosen == ckpt and not sel.incompatible
    # a ZeRO checkpoint still needs its own world size
    assert not reshards(json.loads(commit(make_ckpt(tmp_path, 4)).read_text())["files"])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda c: (c / "optimizer_0/.metadata").unlink(), "optimizer_0/.metadata missing"),
        (lambda c: (c / "pytorch_model_fsdp_0/__1_0.distcp").unlink(), "pytorch_model_fsdp_0/ has shards of ranks [0]"),
        (lambda c: (c / "rng_state_1.pth").unlink(), "rng_state_1.pth missing"),
    ],
)
def test_a_torn_dcp_checkpoint_fails_the_structural_check(tmp_path: Path, damage, reason: str) -> None:
    ckpt = make_dcp_ckpt(tmp_path, 8)
    assert verify(ckpt, require_commit=False, world_size=1).ok  # uncommitted, whole: loadable on any world size
    damage(ckpt)
    v = verify(ckpt, require_commit=False)
    assert not v.ok and reason in v.reason, v.reason
    with pytest.raises(CommitError, match="structur|missing|shards"):
        commit(ckpt, stage=3)


def test_model_weights_are_what_from_pretrained_or_a_custom_loop_reads(tmp_path: Path) -> None:
    """A final model directory without weights (HF's save_model under FSDP's sharded state dict writes only the
    config and tokenizer) is told apart from one with them."""
    for name in ("config.json", "tokenizer.json", "training_args.bin"):
        (tmp_path / name).write_text("{}")
    assert model_weights(tmp_path) == []
    for name in ("model-00001-of-00002.safetensors", "adapter_model.safetensors", "model.pt"):
        (tmp_path / name).write_bytes(b"x")
        assert name in model_weights(tmp_path)
    assert model_weights(tmp_path / "missing") == []


def test_set_aside_newer_moves_rejected_checkpoints(tmp_path: Path) -> None:
    commit(make_ckpt(tmp_path, 10))
    make_ckpt(tmp_path, 20)
    sel = select_resume(tmp_path)
    moved = set_aside_newer(tmp_path, sel)
    assert [p.name.split(".rejected-")[0] for p in moved] == ["checkpoint-20"]
    assert moved[0].is_dir() and not (tmp_path / "checkpoint-20").exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]


# ---------------------------------------------------------------------------------------------- rotation


def test_rotation_keeps_newest_committed_and_never_counts_torn(tmp_path: Path) -> None:
    for step in (10, 30, 40):
        commit(make_ckpt(tmp_path, step))
    make_ckpt(tmp_path, 20)  # torn, older than the newest commit: garbage (ftkit began this save)
    ck.record_save_begun(tmp_path, 20, attempt=0)
    make_ckpt(tmp_path, 50)  # uncommitted and newer than the newest commit: left alone
    removed = rotate(tmp_path, keep=2)
    assert [p.name for p in removed] == ["checkpoint-10", "checkpoint-20"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [50, 40, 30]

    # keep=1 still keeps the newest committed one even though a newer (uncommitted) directory exists.
    assert [p.name for p in rotate(tmp_path, keep=1)] == ["checkpoint-30"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [50, 40]
    assert not any(p.name.startswith(".deleting-") for p in tmp_path.iterdir())


def test_rotation_deletes_set_aside_checkpoints_once_superseded(tmp_path: Path) -> None:
    """A restart sets torn checkpoints aside as checkpoint-N.rejected-*; they used to stay forever. Rotation
    deletes each once a committed checkpoint of step >= N exists, and they never count toward ``keep``."""
    for step in (10, 20):
        commit(make_ckpt(tmp_path, step))
    make_ckpt(tmp_path, 30)  # a save killed before its commit
    ck.record_save_begun(tmp_path, 30, attempt=0)
    bad40 = make_ckpt(tmp_path, 40)
    commit(bad40)
    os.truncate(bad40 / "scheduler.pt", 1)  # torn after its commit
    moved = set_aside_newer(tmp_path, select_resume(tmp_path))
    assert sorted(p.name.split(".rejected-")[0] for p in moved) == ["checkpoint-30", "checkpoint-40"]
    assert [s for s, _ in list_set_aside(tmp_path)] == [30, 40]

    commit(make_ckpt(tmp_path, 30))  # the resumed run redoes step 30
    removed = rotate(tmp_path, keep=2)
    assert [p.name.split(".rejected-")[0] for p in removed] == ["checkpoint-10", "checkpoint-30"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 20]  # keep=2 counts committed checkpoints only
    assert [s for s, _ in list_set_aside(tmp_path)] == [40]  # not yet superseded: kept for a post-mortem

    commit(make_ckpt(tmp_path, 40))
    removed = rotate(tmp_path, keep=2)
    assert sorted(p.name.split(".rejected-")[0] for p in removed) == ["checkpoint-20", "checkpoint-40"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-30", "checkpoint-40", "ftkit"]  # no .deleting


def test_rotation_never_deletes_checkpoints_ftkit_did_not_write(tmp_path: Path) -> None:
    """A plain HF Trainer run's checkpoints in the output directory used to be deleted by rotation (a user's file
    with them) once ftkit's own checkpoints of the same steps committed."""
    for step in (10, 20):
        make_ckpt(tmp_path, step)  # no commit record, no save record: not ftkit's
    (tmp_path / "checkpoint-10" / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert [p.name for p in ck.foreign_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-20"]
    for step in (30, 40):
        ck.record_save_begun(tmp_path, step, attempt=0)
        commit(make_ckpt(tmp_path, step))
    assert rotate(tmp_path, keep=1) == [tmp_path / "checkpoint-30"]
    assert {p: p.read_bytes() for p in before} == before  # every byte of theirs is still there
    assert not ck.written_by_ftkit(tmp_path / "checkpoint-10") and ck.written_by_ftkit(tmp_path / "checkpoint-40")
    assert not (tmp_path / SAVES_DIR / "checkpoint-30.json").exists()  # its save record went with it


def test_rotation_unlinks_a_symlinked_checkpoint_and_leaves_its_target(tmp_path: Path) -> None:
    """Old checkpoints moved to another disk and linked back used to crash rotation (rmtree on a link) and with it
    the rank: one restart per link."""
    out, elsewhere = tmp_path / "run", tmp_path / "other-disk"
    out.mkdir()
    elsewhere.mkdir()
    for step in (10, 20, 30):
        commit(make_ckpt(out, step))
    for step in (10, 20):
        shutil.move(out / f"checkpoint-{step}", elsewhere / f"checkpoint-{step}")
        (out / f"checkpoint-{step}").symlink_to(elsewhere / f"checkpoint-{step}")
    notes: list[str] = []
    removed = rotate(out, keep=1, note=notes.append)
    assert [p.name for p in removed] == ["checkpoint-10", "checkpoint-20"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-30"]
    assert (elsewhere / "checkpoint-10" / "latest").is_file() and (elsewhere / "checkpoint-20" / COMMIT_FILE).is_file()
    assert len(notes) == 2 and "a symbolic link to" in notes[0] and "left in place" in notes[0]


def test_rotation_without_any_commit_deletes_nothing(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20)
    assert rotate(tmp_path, keep=1) == []
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 10]
    with pytest.raises(ValueError):
        rotate(tmp_path, keep=0)


def test_rotation_respects_protect(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        commit(make_ckpt(tmp_path, step))
    assert [p.name for p in rotate(tmp_path, keep=1, protect=[tmp_path / "checkpoint-10"])] == ["checkpoint-20"]


def test_crash_mid_delete_never_leaves_a_checkpoint_lookalike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (10, 20):
        commit(make_ckpt(tmp_path, step))
    real_rmtree = shutil.rmtree

    def crash(path: object, *a: object, **k: object) -> None:
        raise KeyboardInterrupt("killed mid-delete")

    monkeypatch.setattr(ck.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        rotate(tmp_path, keep=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20]
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".deleting-checkpoint-10-")]
    assert len(leftovers) == 1

    monkeypatch.setattr(ck.shutil, "rmtree", real_rmtree)
    assert rotate(tmp_path, keep=1) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-20"]


# ---------------------------------------------------------------------------------------------- import cost


def test_module_is_import_light() -> None:
    code = (
        "import sys, ftkit.checkpoint.commit, ftkit.checkpoint.verify, ftkit.checkpoint.directory; "
        "heavy = {'torch', 'transformers', 'deepspeed', 'accelerate', 'peft'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
