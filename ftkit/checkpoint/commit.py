"""Committing a save: every rank's manifest part (size and a checksum of every byte it wrote, fsynced), and rank 0's
commit record, written atomically only when the parts cover the whole directory and the layout is sound. A checkpoint
is committed exactly when that record exists and verifies (:mod:`ftkit.checkpoint.verify`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from ftkit import __version__
from ftkit.checkpoint.checksums import (
    CHECKSUM_MODES,
    DEFAULT_SPEC,
    SAMPLED,
    XXH3,
    SampleSpec,
    full_checksum,
    sampled_checksum,
)
from ftkit.checkpoint.layout import (
    _ACCELERATE_RNG_RE,
    _MANIFEST_THREADS,
    _RNG_RANK_RE,
    _TMP_PREFIX,
    COMMIT_FILE,
    COMMIT_FORMAT,
    COMMIT_VERSION,
    _fsync_path,
    _fsync_tree_dirs,
    _payload_files,
    _Structure,
    _structure,
    _writer_rank,
    files_owned_by_rank,
)
from ftkit.errors import ExitCode, FtkitError
from ftkit.rundir.layout import atomic_write
from ftkit.rundir.records import CommitExtra, CommitRecord, FileEntry


class CommitError(FtkitError):
    """write_commit refused: the save is incomplete or inconsistent, so claiming it finished would be a lie."""

    exit_code = ExitCode.TRAINING_FAILED


def manifest_part(
    ckpt_dir: str | os.PathLike[str],
    rank: int,
    world_size: int,
    *,
    checksum: str = "full",
    fsync: bool = True,
    spec: SampleSpec = DEFAULT_SPEC,
    files: list[str] | None = None,
) -> dict[str, FileEntry]:
    """``{relative path: {size, checksum, rank}}`` for the files this rank wrote (``files``: these instead of
    the ones :func:`files_owned_by_rank` assigns it, e.g. one node's part of a local checkpoint).

    Call it right after the save, so the bytes are read back from the page cache rather than the disk.
    ``checksum="full"`` (the default, ``resilience.checksum``) hashes every byte with XXH3-128;
    ``"sampled"`` reads only windows of files over ``spec.small_file_bytes`` (see :func:`sampled_checksum`).
    ``fsync=True`` flushes each file to stable storage first: torch.save does not, and a commit record that
    survives a node crash while the shards it describes were still in the page cache would be a lie.
    """
    if checksum not in CHECKSUM_MODES:
        raise ValueError(f"checksum must be one of {', '.join(CHECKSUM_MODES)}, got {checksum!r}")
    ckpt = Path(ckpt_dir)

    def one(rel: str) -> tuple[str, FileEntry]:
        path = ckpt / rel
        if fsync:
            _fsync_path(path)
        size = path.stat().st_size
        # This rank wrote the file and nobody touches it before the barrier: safe to hash it mapped.
        digest = full_checksum(path, use_mmap=True) if checksum == "full" else sampled_checksum(path, spec)
        return rel, {"size": size, "checksum": digest, "rank": rank}

    if files is None:
        files = files_owned_by_rank(ckpt, rank, world_size)
    if len(files) <= 1:
        return dict(map(one, files))
    # A few threads: fsync and hashing release the GIL, and concurrent fsyncs share the filesystem's journal
    # commits (rank 0 owns a dozen small files, each fsync otherwise waiting for its own device flush).
    with ThreadPoolExecutor(max_workers=min(_MANIFEST_THREADS, len(files))) as pool:
        return dict(pool.map(one, files))


def _check_accelerate_processes(name: str, present: Iterable[str], world_size: int) -> None:
    """``Accelerator.save_state`` writes ``random_states_<process>.pkl`` on every process: a set that does not
    match the world size means the script's Accelerator ran each rank as a job of its own (every one "process 0",
    all writing the same files), so the state is not this run's and must not be resumed."""
    procs = {int(m.group(1)) for rel in present if (m := _ACCELERATE_RNG_RE.match(rel))}
    if procs and procs != set(range(world_size)):
        got = ", ".join(map(str, sorted(procs)))
        raise CommitError(
            f"{name}: Accelerate saved the state of process(es) {got} for world size {world_size}: the script's "
            "Accelerator does not see the run's process group (on CPU ranks: pass Accelerator(cpu=True), or build "
            "it after the first ftkit.hf call, whose start-up makes Accelerate's process state CPU)"
        )


def write_commit(
    ckpt_dir: str | os.PathLike[str],
    parts: Iterable[Mapping[str, FileEntry]],
    *,
    step: int,
    world_size: int,
    stage: int | None,
    recipe_hash: str,
    extra: CommitExtra | None = None,
    spec: SampleSpec = DEFAULT_SPEC,
    kind: str = "checkpoint",
) -> Path:
    """Merge the ranks' manifest parts and write the commit record atomically; returns its path.

    ``kind="model"`` commits a final model directory (HF weights, no trainer state), ``kind="state"`` a training
    loop's own checkpoint (:func:`ftkit.hf.checkpoint`, e.g. ``Accelerator.save_state``), ``kind="node"`` one
    node's part of a local-tier checkpoint (:mod:`ftkit.checkpoint.tiers`): the coverage and size checks apply, HF
    Trainer's checkpoint structure and RNG checks (which need every rank's files) do not.

    Refuses (:class:`CommitError`) when a file in the directory is covered by no part, a listed file is gone or
    changed size since its rank measured it (the caller's barrier was missing), two parts disagree about a file,
    or the structural check fails (e.g. ``trainer_state.json`` missing): a commit must only ever be claimed for a
    checkpoint that resume can load. ``stage`` is the ZeRO stage (None: not a DeepSpeed run). The write is
    temp file in the same directory → fsync → ``os.replace`` → fsync of the directory, so a crash leaves either
    no record or a complete one, never a partial one.
    """
    ckpt = Path(ckpt_dir)
    name = ckpt.name
    if world_size < 1 or (stage is not None and stage not in (0, 1, 2, 3)) or step < 0:
        raise ValueError(f"invalid commit parameters step={step} world_size={world_size} stage={stage}")
    if not ckpt.is_dir():
        raise CommitError(f"{name}: not a directory")

    merged: dict[str, FileEntry] = {}
    for part in parts:
        for rel, entry in part.items():
            clean: FileEntry = {
                "size": int(entry["size"]),
                "checksum": str(entry["checksum"]),
                "rank": int(entry["rank"]),
            }
            if rel in merged and merged[rel] != clean:
                raise CommitError(f"{name}: ranks {merged[rel]['rank']} and {clean['rank']} disagree about {rel}")
            merged[rel] = clean

    present = _payload_files(ckpt)
    if kind == "state":
        _check_accelerate_processes(name, present, world_size)
    uncovered = [rel for rel in present if rel not in merged]
    if uncovered:
        owners = ", ".join(f"{rel} (rank {_writer_rank(rel)})" for rel in uncovered[:5])
        more = f" and {len(uncovered) - 5} more" if len(uncovered) > 5 else ""
        raise CommitError(f"{name}: not covered by any rank's manifest (world size {world_size}): {owners}{more}")
    for rel in sorted(merged):
        try:
            size = (ckpt / rel).stat().st_size
        except FileNotFoundError:
            raise CommitError(f"{name}: {rel} is in rank {merged[rel]['rank']}'s manifest but does not exist") from None
        if size != merged[rel]["size"]:
            raise CommitError(
                f"{name}: {rel} is {size} bytes, rank {merged[rel]['rank']} measured {merged[rel]['size']}"
            )

    # a final model, a training loop's own state (ftkit.hf.checkpoint), or one node's part of a local checkpoint
    if kind in ("model", "state", "node"):
        structure = _Structure()
    else:
        structure = _structure(ckpt, stage=stage, expect_step=step)
    if structure.problem:
        raise CommitError(f"{name}: {structure.problem}")
    if structure.world_size is not None and structure.world_size != world_size:
        raise CommitError(
            f"{name}: found optimizer shards for {structure.world_size} ranks, world size is {world_size}"
        )
    rng = {rel for rel in present if rel == "rng_state.pth" or _RNG_RANK_RE.match(rel)}
    want = {"rng_state.pth"} if world_size == 1 else {f"rng_state_{r}.pth" for r in range(world_size)}
    if (
        kind == "checkpoint" and rng and rng != want
    ):  # no RNG files at all is HF's save_only_model; a partial set is a rank that is late
        odd = sorted(want - rng) or sorted(rng - want)
        raise CommitError(f"{name}: RNG files do not match world size {world_size} ({odd[0]} missing or extra)")

    now = time.time()
    record: CommitRecord = {
        "format": COMMIT_FORMAT,
        "version": COMMIT_VERSION,
        "ftkit_version": __version__,
        "step": step,
        "created": now,
        "created_utc": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds"),
        "world_size": world_size,
        "stage": stage,
        "recipe_hash": recipe_hash,
        "tag": structure.tag,
        "checksum": (
            {"mode": "sampled", **spec.to_json()}
            if any(e["checksum"].startswith(SAMPLED + ":") for e in merged.values())
            else {"mode": "full", "name": XXH3}
        ),
        "kind": kind,
        "files": dict(sorted(merged.items())),
        "extra": CommitExtra(**(extra or {})),
    }
    _fsync_tree_dirs(ckpt)  # the data files' directory entries must be durable before the record is
    atomic_write(ckpt / COMMIT_FILE, json.dumps(record, indent=1, sort_keys=False).encode() + b"\n", sync_dir=True)
    for stale in ckpt.glob(_TMP_PREFIX + "*"):  # from a write_commit that crashed before its rename
        stale.unlink(missing_ok=True)
    return ckpt / COMMIT_FILE
