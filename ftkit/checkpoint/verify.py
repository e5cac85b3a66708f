"""Whether a checkpoint can be resumed from: its commit record parses, every listed file exists with its size and (by
default) its checksum, and it was saved with this launch's world size and ZeRO stage; or, without a record, its
structure (for runs ftkit did not write). Never raises for an unreadable file: the verdict says why."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ftkit.checkpoint.checksums import (
    ALGORITHMS,
    DEFAULT_SPEC,
    SAMPLED,
    SampleSpec,
    recompute_or_error,
)
from ftkit.checkpoint.layout import (
    COMMIT_FILE,
    COMMIT_FORMAT,
    COMMIT_VERSION,
    LATEST,
    _checkpoint_step,
    _read_tag,
    _structure,
    read_commit,
    reshards,
)
from ftkit.rundir.records import CommitRecord


class VerdictKind:
    """Why a checkpoint was accepted or rejected; callers branch on these, humans read ``Verdict.reason``."""

    OK = "ok"
    NO_COMMIT = "no_commit"  # no commit record and require_commit=True
    BAD_COMMIT = "bad_commit"  # the record exists but is unreadable, of an unknown version, or inconsistent
    TORN = "torn"  # a file the record lists is missing, has another size, or fails its checksum
    STRUCTURE = "structure"  # structural check failed (missing trainer_state.json, dangling `latest`, ...)
    WORLD_SIZE_MISMATCH = "world_size_mismatch"  # valid, but saved with another world size
    STAGE_MISMATCH = "stage_mismatch"  # valid, but saved with another ZeRO stage

    INCOMPATIBLE = frozenset({WORLD_SIZE_MISMATCH, STAGE_MISMATCH})


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one checkpoint directory.

    ``kind`` in :attr:`VerdictKind.INCOMPATIBLE` means the checkpoint is intact but cannot be loaded by the
    current launch (ftkit converts one to a universal checkpoint only when it shrinks a running job itself): the
    caller should usually refuse the launch rather than silently resume from an older checkpoint and lose progress.
    """

    ok: bool
    committed: bool
    reason: str
    step: int | None
    kind: str = VerdictKind.OK
    path: Path | None = None
    record: CommitRecord | None = field(default=None, repr=False, compare=False)

    @property
    def incompatible(self) -> bool:
        return self.kind in VerdictKind.INCOMPATIBLE


class _MakeVerdict(Protocol):
    def __call__(
        self,
        ok: bool,
        committed: bool,
        kind: str,
        reason: str,
        step: int | None = ...,
        record: CommitRecord | None = None,
    ) -> Verdict: ...


def verify(
    ckpt_dir: str | os.PathLike[str],
    checksums: bool = True,
    *,
    require_commit: bool = True,
    world_size: int | None = None,
    stage: int | None = None,
) -> Verdict:
    """Is this checkpoint safe to resume from, and if not, why (one line, starting with the directory name)?

    Committed: the record parses, every listed file exists with exactly the recorded size and, unless
    ``checksums=False``, its content matches the recorded checksum (the record names the algorithm: full or
    sampled, as saved; this reads every byte of a fully checksummed checkpoint), and ``latest`` names an existing
    directory. ``checksums=False`` (sizes only) is for cheap, repeated looks such as :func:`rotate` and a plain
    ``ftkit status``; never for choosing what to resume from. Integrity is checked before compatibility, so a
    world-size/stage mismatch verdict always means "intact but not loadable by this launch". Uncommitted: rejected
    (``no_commit``) when ``require_commit``, else the structural check (for runs not written by ftkit).
    ``world_size``/``stage`` None skip that check. A file that cannot be read (permissions, a symlink loop, I/O
    error) rejects the checkpoint with the OS's reason; it never raises.
    """
    ckpt = Path(ckpt_dir)
    name = ckpt.name
    dir_step = _checkpoint_step(ckpt)

    def verdict(
        ok: bool,
        committed: bool,
        kind: str,
        reason: str,
        step: int | None = dir_step,
        record: CommitRecord | None = None,
    ) -> Verdict:
        return Verdict(ok, committed, f"{name}: {reason}", step, kind, ckpt, record)

    try:
        return _verify(ckpt, checksums, require_commit, world_size, stage, verdict)
    except OSError as e:
        where = name
        if isinstance(e.filename, str):
            where = os.path.relpath(e.filename, ckpt) if e.filename.startswith(str(ckpt) + os.sep) else e.filename
        committed = (ckpt / COMMIT_FILE).is_file()
        kind = VerdictKind.TORN if committed else VerdictKind.STRUCTURE
        return verdict(False, committed, kind, f"cannot read {where} ({e.strerror or e})")


def _verify(
    ckpt: Path,
    checksums: bool,
    require_commit: bool,
    world_size: int | None,
    stage: int | None,
    verdict: _MakeVerdict,
) -> Verdict:
    dir_step = _checkpoint_step(ckpt)

    if not ckpt.is_dir():
        return verdict(False, False, VerdictKind.STRUCTURE, "not a directory")
    try:
        record = read_commit(ckpt)
    except (OSError, ValueError) as e:
        return verdict(False, True, VerdictKind.BAD_COMMIT, f"commit record unreadable ({e})")

    if record is None:
        structure = _structure(ckpt, stage=stage, expect_step=dir_step)
        if require_commit:
            # Both ftkit runs (a rank killed between the Trainer's save and ftkit's commit) and checkpoints
            # written without ftkit end up here; the message must be true for both.
            why = structure.problem or "files look complete; killed before ftkit's commit, or not written by ftkit"
            return verdict(False, False, VerdictKind.NO_COMMIT, f"no commit record: the save did not finish ({why})")
        if structure.problem:
            return verdict(False, False, VerdictKind.STRUCTURE, structure.problem)
        if structure.reshards:
            world_size = stage = None  # DCP loads on any world size and either FSDP2 resharding choice
        if world_size is not None and structure.world_size is not None and structure.world_size != world_size:
            return verdict(
                False,
                False,
                VerdictKind.WORLD_SIZE_MISMATCH,
                f"saved by {structure.world_size} ranks, this launch has {world_size} "
                "(resuming needs the same world size and stage)",
            )
        if stage is not None and structure.stage3 is not None and structure.stage3 != (stage == 3):
            saved = "stage 3" if structure.stage3 else "stage 0-2"
            return verdict(
                False,
                False,
                VerdictKind.STAGE_MISMATCH,
                f"saved with ZeRO {saved}, this launch uses stage {stage} "
                "(resuming needs the same world size and stage)",
            )
        return verdict(True, False, VerdictKind.OK, "no commit record; structural check passed")

    return _verify_committed(ckpt, record, checksums, world_size, stage, verdict)


def _verify_committed(
    ckpt: Path,
    record: CommitRecord,
    checksums: bool,
    world_size: int | None,
    stage: int | None,
    verdict: _MakeVerdict,
) -> Verdict:
    bad = VerdictKind.BAD_COMMIT
    try:
        if record.get("format") != COMMIT_FORMAT:
            return verdict(False, True, bad, f"{COMMIT_FILE} is not an ftkit commit record")
        version = record.get("version")
        if not isinstance(version, int) or version > COMMIT_VERSION:
            return verdict(
                False, True, bad, f"commit record version {version!r} is newer than supported ({COMMIT_VERSION})"
            )
        step, files = record["step"], record["files"]
        rec_world, rec_stage = record["world_size"], record["stage"]
        if not isinstance(step, int) or not isinstance(files, dict) or not files:
            raise TypeError("step/files have the wrong type")
        entries = {rel: (int(e["size"]), str(e["checksum"])) for rel, e in files.items()}
        algorithms = {digest.split(":", 1)[0] for _, digest in entries.values()}
        if unknown := sorted(algorithms - ALGORITHMS):
            raise ValueError(f"unknown checksum algorithm {unknown[0]!r}")
        # Only the sampled digest has parameters; they are read from the record, never from today's defaults.
        spec = SampleSpec.from_json(record["checksum"]) if SAMPLED in algorithms else DEFAULT_SPEC
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return verdict(False, True, bad, f"commit record malformed ({type(e).__name__}: {e})")

    dir_step = _checkpoint_step(ckpt)
    if dir_step is not None and step != dir_step:
        return verdict(False, True, bad, f"commit record is for step {step}", step=dir_step)

    for rel, (size, _) in sorted(entries.items()):
        if rel.startswith("/") or ".." in rel.split("/"):
            return verdict(False, True, bad, f"commit record lists a path outside the checkpoint: {rel}", step=step)
        try:
            actual = (ckpt / rel).stat().st_size
        except FileNotFoundError:
            return verdict(
                False, True, VerdictKind.TORN, f"{rel} is listed in the commit record but missing", step=step
            )
        if actual != size:
            return verdict(
                False, True, VerdictKind.TORN, f"{rel} is {actual} bytes, commit record says {size}", step=step
            )
    if LATEST in entries:
        _, problem = _read_tag(ckpt)
        if problem:
            return verdict(False, True, VerdictKind.TORN, problem, step=step)

    mode = "sizes"
    if checksums:
        mode = "sizes+checksums"
        items = sorted(entries.items())
        with ThreadPoolExecutor(max_workers=min(8, len(items))) as pool:
            results = list(pool.map(lambda it: recompute_or_error(ckpt / it[0], it[1][1], spec), items))
        for (rel, (_, expected)), actual_sum in zip(items, results, strict=True):
            if actual_sum != expected:
                return verdict(
                    False, True, VerdictKind.TORN, f"{rel} checksum {actual_sum} != commit record {expected}", step=step
                )

    if reshards(entries):
        world_size = stage = None  # DCP loads on any world size and either FSDP2 resharding choice
    if world_size is not None and rec_world != world_size:
        return verdict(
            False,
            True,
            VerdictKind.WORLD_SIZE_MISMATCH,
            f"committed with world size {rec_world}, this launch has {world_size} "
            "(resuming needs the same world size and stage)",
            step=step,
            record=record,
        )
    if stage is not None and rec_stage is not None and rec_stage != stage:
        return verdict(
            False,
            True,
            VerdictKind.STAGE_MISMATCH,
            f"committed with ZeRO stage {rec_stage}, this launch uses stage {stage} "
            "(resuming needs the same world size and stage)",
            step=step,
            record=record,
        )
    return verdict(
        True, True, VerdictKind.OK, f"committed, {len(entries)} files verified ({mode})", step=step, record=record
    )
