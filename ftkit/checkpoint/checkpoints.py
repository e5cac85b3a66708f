"""Checkpoint commit records, verification, resume selection and rotation (DESIGN §5).

Why this module exists: HF Trainer writes ``checkpoint-N/`` in place, piece by piece (model, DeepSpeed's
``global_stepN/`` shards and ``latest``, per-rank RNG files, ``trainer_state.json``), with no marker that says
"this save finished on every rank". ``get_last_checkpoint`` simply takes the highest N, and resuming from a torn
one crashes the resumed run (measured: a truncated optimizer shard). So ftkit owns the notion of *committed*:

1. after the Trainer's save, every rank calls :func:`manifest_part` for the files it wrote (size + a checksum of
   every byte, and an fsync so the data is durable before anything claims it is);
2. the caller gathers the parts on rank 0 (the ``torch.distributed`` gather/barrier is the caller's job; this
   module stays stdlib-only because the supervisor on the head node imports it);
3. rank 0 calls :func:`write_commit`, which refuses unless the parts cover every file in the directory and the
   layout is structurally sound, then writes ``ftkit_commit.json`` atomically (temp file, fsync, rename, fsync
   of the directory). A checkpoint is committed exactly when that file exists and verifies.

Resume (:func:`select_resume`) walks from newest to oldest and takes the first checkpoint that verifies, by
default re-reading every file against its recorded checksum (a same-size corrupted shard must never resume as
"verified": seen, 16 flipped bytes in an optimizer shard trained on to losses of 0.0); checkpoints without a record
are rejected (``require_commit=True``) or, for runs not written by ftkit, checked structurally. Rotation
(:func:`rotate`) counts only committed checkpoints, never removes the newest one, and deletes checkpoints a restart
set aside (``checkpoint-N.rejected-*``) once a committed checkpoint of step N or later exists.

Checksums (:mod:`ftkit.checkpoint.checksums`): XXH3-128 (xxHash) over the whole content by default, ``xxh3_128:<hex>``
in the record. It is not cryptographic (nor need it be: it guards against torn writes and bit rot, not an attacker)
and runs at several GB/s per core, so hashing a file right after writing it, while it is still in the page cache,
costs little next to the write (``benchmarks/commit_cost.py`` measures it). ``checksum="sampled"``
(``resilience.checksum``) is an explicit opt-in for checkpoints too large to read once per save: it reads about
1.1 MiB of each file over 8 MiB and misses changes between its windows. Records written by earlier versions
(``blake2b``, ``blake2b-sampled``) still verify.

Assumes the checkpoint directory is on a filesystem every rank and the head node see (shared storage), as HF
Trainer + DeepSpeed multi-node saving does by default.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ftkit import __version__
from ftkit.checkpoint.checksums import (
    ALGORITHMS,
    CHECKSUM_MODES,
    DEFAULT_SPEC,
    SAMPLED,
    XXH3,
    SampleSpec,
    full_checksum,
    recompute_or_error,
    sampled_checksum,
)
from ftkit.errors import ExitCode, FtkitError

COMMIT_FILE = "ftkit_commit.json"
COMMIT_FORMAT = "ftkit-checkpoint-commit"
# Bump when a reader of the old version would misread the new one. 2: xxh3_128 checksums (version 1 readers
# would call every such file torn); the "checksum" field names the mode. Version 1 records are still read.
COMMIT_VERSION = 2
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
DELETING_PREFIX = ".deleting-"  # never matches checkpoint-<int>, so a half-deleted tree never looks resumable
_TMP_PREFIX = f".{COMMIT_FILE}.tmp-"

_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")  # the same rule as transformers' get_last_checkpoint
_SET_ASIDE_RE = re.compile(r"^checkpoint-(\d+)\.rejected-")  # set_aside_newer's names: outside _CKPT_RE's namespace
_ZERO_RANK_RE = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")  # DeepSpeed's per-DP-rank shards; not mp_rank_00
_RNG_RANK_RE = re.compile(r"^rng_state_(\d+)\.pth$")
_ACCELERATE_RNG_RE = re.compile(r"^random_states_(\d+)\.pkl$")  # Accelerator.save_state, one per process
_OFFLOAD_RANK_RE = re.compile(r"^rank(\d+)$")  # global_stepN/offloaded_tensors/rank00/ (NVMe offload)
_TAG_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

_MANIFEST_THREADS = 4  # per rank; several ranks share a node's cores
# A record per save ftkit began, written by every rank before the Trainer writes a byte of checkpoint-N: an
# uncommitted checkpoint with one is ftkit's own torn save (set aside, rotated away); without one it was written
# by something else (a plain HF Trainer run, a copy) and ftkit never resumes from it, moves it or deletes it.
SAVES_DIR = "ftkit/saves"  # relative to the output (run) directory


class CommitError(FtkitError):
    """write_commit refused: the save is incomplete or inconsistent, so claiming it finished would be a lie."""

    exit_code = ExitCode.TRAINING_FAILED


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
    record: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def incompatible(self) -> bool:
        return self.kind in VerdictKind.INCOMPATIBLE


@dataclass(frozen=True)
class Selection:
    """The checkpoint to resume from (``chosen`` is None: start fresh) and every newer one that was rejected."""

    chosen: Path | None
    step: int | None
    verdict: Verdict | None
    rejected: list[Verdict]

    @property
    def incompatible(self) -> list[Verdict]:
        """Rejected checkpoints that are intact but were saved with another world size or ZeRO stage."""
        return [v for v in self.rejected if v.incompatible]

    @property
    def rejected_reasons(self) -> list[tuple[Path | None, str]]:
        return [(v.path, v.reason) for v in self.rejected]


# --------------------------------------------------------------------------------------------------- manifests


def _is_bookkeeping(rel: str) -> bool:
    """Files that are not part of the checkpoint payload: our own record and temp files, NFS silly-renames."""
    name = rel.rsplit("/", 1)[-1]
    if rel == COMMIT_FILE or (name == rel and name.startswith(_TMP_PREFIX)):
        return True
    # NFS renames a file that is deleted while open to .nfsXXXX until the last handle closes; not ours to cover.
    return name.startswith(".nfs")


def _payload_files(ckpt_dir: Path) -> list[str]:
    """Every regular file under ``ckpt_dir`` (relative, '/'-separated, sorted), minus bookkeeping files."""
    out: list[str] = []
    for root, dirs, files in os.walk(ckpt_dir):
        dirs.sort()
        rel_root = Path(root).relative_to(ckpt_dir).as_posix()
        for name in files:
            rel = name if rel_root == "." else f"{rel_root}/{name}"
            if not _is_bookkeeping(rel):
                out.append(rel)
    return sorted(out)


def _writer_rank(rel: str) -> int:
    """The rank that writes ``rel`` in HF Trainer + DeepSpeed's layout; 0 for everything not per-rank."""
    parts = rel.split("/")
    name = parts[-1]
    if m := _RNG_RANK_RE.match(name) or _ACCELERATE_RNG_RE.match(name):
        return int(m.group(1))
    if m := _ZERO_RANK_RE.search(name):
        return int(m.group(1))
    for i, comp in enumerate(parts[:-2]):
        if comp == "offloaded_tensors" and (m := _OFFLOAD_RANK_RE.match(parts[i + 1])):
            return int(m.group(1))
    return 0


def files_owned_by_rank(ckpt_dir: str | os.PathLike[str], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` checksums: the ones it wrote, so the cost is spread like the save itself.

    ``zero_pp_rank_{r}_...`` (ZeRO shards), ``rng_state_{r}.pth`` and NVMe ``offloaded_tensors/rank{r}/``
    belong to rank r; everything else (model weights, ``latest``, ``mp_rank_00_model_states.pt``, scheduler,
    ``trainer_state.json``, ...) to rank 0. A file naming a rank >= ``world_size`` belongs to nobody: it is a
    leftover from a run with more ranks, and :func:`write_commit` then refuses because it is not covered.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    return [rel for rel in _payload_files(Path(ckpt_dir)) if _writer_rank(rel) == rank]


def manifest_part(
    ckpt_dir: str | os.PathLike[str],
    rank: int,
    world_size: int,
    *,
    checksum: str = "full",
    fsync: bool = True,
    spec: SampleSpec = DEFAULT_SPEC,
) -> dict[str, dict[str, Any]]:
    """``{relative path: {size, checksum, rank}}`` for the files this rank wrote.

    Call it right after the save, so the bytes are read back from the page cache rather than the disk.
    ``checksum="full"`` (the default, ``resilience.checksum``) hashes every byte with XXH3-128;
    ``"sampled"`` reads only windows of files over ``spec.small_file_bytes`` (see :func:`sampled_checksum`).
    ``fsync=True`` flushes each file to stable storage first: torch.save does not, and a commit record that
    survives a node crash while the shards it describes were still in the page cache would be a lie.
    """
    if checksum not in CHECKSUM_MODES:
        raise ValueError(f"checksum must be one of {', '.join(CHECKSUM_MODES)}, got {checksum!r}")
    ckpt = Path(ckpt_dir)

    def one(rel: str) -> tuple[str, dict[str, Any]]:
        path = ckpt / rel
        if fsync:
            _fsync_path(path)
        size = path.stat().st_size
        # This rank wrote the file and nobody touches it before the barrier: safe to hash it mapped.
        digest = full_checksum(path, use_mmap=True) if checksum == "full" else sampled_checksum(path, spec)
        return rel, {"size": size, "checksum": digest, "rank": rank}

    files = files_owned_by_rank(ckpt, rank, world_size)
    if len(files) <= 1:
        return dict(map(one, files))
    # A few threads: fsync and hashing release the GIL, and concurrent fsyncs share the filesystem's journal
    # commits (rank 0 owns a dozen small files, each fsync otherwise waiting for its own device flush).
    with ThreadPoolExecutor(max_workers=min(_MANIFEST_THREADS, len(files))) as pool:
        return dict(pool.map(one, files))


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on directories/read-only fds; nothing more we can do
        if e.errno not in (22, 9):  # EINVAL, EBADF
            raise
    finally:
        os.close(fd)


def _fsync_tree_dirs(root: Path) -> None:
    """fsync every directory under root, deepest first: new directory entries are durable only after this."""
    dirs = [Path(r) for r, _, _ in os.walk(root)]
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        _fsync_path(d, directory=True)


# --------------------------------------------------------------------------------------------------- commit


def _checkpoint_step(path: Path) -> int | None:
    m = _CKPT_RE.match(path.name)
    return int(m.group(1)) if m else None


def write_commit(
    ckpt_dir: str | os.PathLike[str],
    parts: Iterable[Mapping[str, Mapping[str, Any]]],
    *,
    step: int,
    world_size: int,
    stage: int | None,
    recipe_hash: str,
    extra: Mapping[str, Any] | None = None,
    spec: SampleSpec = DEFAULT_SPEC,
    kind: str = "checkpoint",
) -> Path:
    """Merge the ranks' manifest parts and write the commit record atomically; returns its path.

    ``kind="model"`` commits a final model directory (HF weights, no trainer state), ``kind="state"`` a training
    loop's own checkpoint (:func:`ftkit.hf.checkpoint`, e.g. ``Accelerator.save_state``): the coverage and size
    checks apply, HF Trainer's checkpoint structure and RNG checks do not.

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

    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        for rel, entry in part.items():
            clean = {"size": int(entry["size"]), "checksum": str(entry["checksum"]), "rank": int(entry["rank"])}
            if rel in merged and merged[rel] != clean:
                raise CommitError(f"{name}: ranks {merged[rel]['rank']} and {clean['rank']} disagree about {rel}")
            merged[rel] = clean

    present = _payload_files(ckpt)
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

    if kind in ("model", "state"):  # a final model, or a training loop's own state (ftkit.hf.checkpoint)
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
    record: dict[str, Any] = {
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
        "extra": dict(extra or {}),
    }
    _fsync_tree_dirs(ckpt)  # the data files' directory entries must be durable before the record is
    _atomic_write(ckpt / COMMIT_FILE, json.dumps(record, indent=1, sort_keys=False).encode() + b"\n")
    for stale in ckpt.glob(_TMP_PREFIX + "*"):  # from a write_commit that crashed before its rename
        stale.unlink(missing_ok=True)
    return ckpt / COMMIT_FILE


def _atomic_write(target: Path, data: bytes) -> None:
    tmp = target.with_name(f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(target.parent, directory=True)


def read_commit(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The commit record as a dict, or None when there is none. Raises ValueError when it does not parse."""
    path = Path(ckpt_dir) / COMMIT_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    record = json.loads(raw)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return record


# --------------------------------------------------------------------------------------------------- ownership


def _save_record(output_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(output_dir) / SAVES_DIR / f"checkpoint-{step}.json"


def record_save_begun(output_dir: str | os.PathLike[str], step: int, attempt: int) -> None:
    """Every rank, before the Trainer writes ``checkpoint-<step>``: this save is ftkit's (see :data:`SAVES_DIR`).
    Written atomically and durably; several ranks writing the same record is harmless (the same content)."""
    target = _save_record(output_dir, step)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({"step": step, "attempt": attempt}).encode()
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    _fsync_path(target.parent, directory=True)


def written_by_ftkit(path: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint directory ``path`` is ftkit's: it has a commit record (intact or not), or ftkit
    recorded beginning its save. Anything else ftkit did not write and must leave alone."""
    ckpt = Path(path)
    step = _checkpoint_step(ckpt)
    if os.path.lexists(ckpt / COMMIT_FILE):
        return True
    return step is not None and _save_record(ckpt.parent, step).is_file()


def foreign_checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """``checkpoint-<int>`` directories in ``output_dir`` that ftkit did not write, oldest first."""
    return sorted((p for _, p in list_checkpoints(output_dir) if not written_by_ftkit(p)), key=_checkpoint_step)


# --------------------------------------------------------------------------------------------------- verify


@dataclass
class _Structure:
    problem: str | None = None
    tag: str | None = None
    world_size: int | None = None  # inferred from DeepSpeed's optimizer shards, when there are any
    stage3: bool | None = None  # zero_pp_rank_*_model_states.pt exist only at stage 3


def _read_tag(ckpt: Path) -> tuple[str | None, str | None]:
    """(tag, problem) from the ``latest`` file DeepSpeed writes after its shards."""
    try:
        tag = (ckpt / LATEST).read_text(encoding="utf-8", errors="replace").strip()
    except OSError as e:
        return None, f"`latest` unreadable ({e.strerror})"
    if not tag:
        return None, "`latest` is empty"
    if not _TAG_RE.match(tag) or tag in (".", ".."):
        return None, f"`latest` holds {tag[:40]!r}, not a tag directory name"
    if not (ckpt / tag).is_dir():
        return None, f"`latest` names {tag} which does not exist"
    return tag, None


def _structure(ckpt: Path, *, stage: int | None, expect_step: int | None) -> _Structure:
    """The structural check, for checkpoints without a commit record and before writing one.

    Relies on HF Trainer's write order: DeepSpeed's shards and ``latest`` come before its final barrier, then
    each rank's RNG file, then rank 0's ``trainer_state.json``. So ``trainer_state.json`` present means every
    rank's shards were complete; only other ranks' RNG files can still be missing, and those are checked.
    """
    st = _Structure()
    state_path = ckpt / TRAINER_STATE
    if not state_path.is_file():
        st.problem = f"{TRAINER_STATE} missing"
        return st
    try:
        state = json.loads(state_path.read_bytes())
        global_step = state["global_step"]
        if not isinstance(global_step, int):
            raise TypeError("global_step is not an integer")
    except (ValueError, KeyError, TypeError) as e:
        st.problem = f"{TRAINER_STATE} does not parse ({type(e).__name__}: {e})"
        return st
    if expect_step is not None and global_step != expect_step:
        st.problem = f"{TRAINER_STATE} says global_step {global_step}, expected {expect_step}"
        return st

    files = _payload_files(ckpt)
    for rel in files:
        if (ckpt / rel).stat().st_size == 0:
            st.problem = f"{rel} is empty (0 bytes)"
            return st

    top = set(files)
    rng_ranks = sorted(int(m.group(1)) for rel in top if (m := _RNG_RANK_RE.match(rel)))
    has_single_rng = "rng_state.pth" in top
    tag_dirs = sorted(p.name for p in ckpt.glob("global_step*") if p.is_dir())

    if (ckpt / LATEST).exists():
        tag, problem = _read_tag(ckpt)
        if problem or tag is None:
            st.problem = problem
            return st
        st.tag = tag
        names = [rel[len(tag) + 1 :] for rel in files if rel.startswith(tag + "/") and rel.count("/") == 1]
        model_states = [n for n in names if n.endswith("model_states.pt")]
        optim = [n for n in names if n.endswith("optim_states.pt")]
        if not model_states:
            st.problem = f"{tag}/ has no *model_states.pt"
            return st
        if not optim and stage != 0:  # only ZeRO stage 0 without bf16 keeps the optimizer in the model states
            st.problem = f"{tag}/ has no *optim_states.pt"
            return st
        optim_ranks = sorted(int(m.group(1)) for n in optim if (m := _ZERO_RANK_RE.search(n)))
        if optim and optim_ranks != list(range(len(optim))):
            st.problem = f"{tag}/ optimizer shards for ranks {optim_ranks}, expected 0..{len(optim) - 1}"
            return st
        zero3_model = sorted(int(m.group(1)) for n in model_states if (m := _ZERO_RANK_RE.search(n)))
        st.stage3 = bool(zero3_model)
        if zero3_model and zero3_model != (optim_ranks or list(range(len(zero3_model)))):
            st.problem = f"{tag}/ model-state shards for ranks {zero3_model} but optimizer shards for {optim_ranks}"
            return st
        if optim or zero3_model:
            st.world_size = len(optim) or len(zero3_model)
            why = f"{tag}/ has shards for {st.world_size} rank(s)"
            st.problem = _rng_problem(rng_ranks, has_single_rng, st.world_size, why)
            return st
    elif tag_dirs:
        st.problem = f"{tag_dirs[-1]}/ exists but `latest` is missing (DeepSpeed save did not finish)"
        return st
    # No per-rank shards to count ranks by: only the RNG files' own consistency can be checked.
    if rng_ranks and rng_ranks != list(range(len(rng_ranks))):
        missing = sorted(set(range(max(rng_ranks) + 1)) - set(rng_ranks))
        st.problem = f"rng_state_{missing[0]}.pth missing (found ranks {rng_ranks})"
    elif "optimizer.pt" in top and not rng_ranks and not has_single_rng:
        st.problem = "optimizer.pt present but no rng_state file (save did not finish)"
    return st


def _rng_problem(rng_ranks: list[int], has_single: bool, ranks: int, why: str) -> str | None:
    if ranks == 1:
        if has_single or rng_ranks == [0]:
            return None
        return "rng_state.pth missing (save did not finish)"
    missing = sorted(set(range(ranks)) - set(rng_ranks))
    if missing:
        return f"rng_state_{missing[0]}.pth missing ({why}; save did not finish)"
    extra = sorted(set(rng_ranks) - set(range(ranks)))
    if extra:
        return f"rng_state_{extra[0]}.pth present but {why}"
    return None


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

    def verdict(ok: bool, committed: bool, kind: str, reason: str, step: int | None = dir_step, **kw: Any) -> Verdict:
        return Verdict(ok, committed, f"{name}: {reason}", step, kind, ckpt, **kw)

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
    ckpt: Path, checksums: bool, require_commit: bool, world_size: int | None, stage: int | None, verdict: Any
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
    ckpt: Path, record: dict[str, Any], checksums: bool, world_size: int | None, stage: int | None, verdict: Any
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


# --------------------------------------------------------------------------------------------------- selection


def _scan(output_dir: str | os.PathLike[str], pattern: re.Pattern[str], follow: bool) -> list[tuple[int, Path]]:
    """``(step, path)`` of the directories in ``output_dir`` whose name matches ``pattern`` (group 1: the step)."""
    out: list[tuple[int, Path]] = []
    try:
        entries = list(os.scandir(output_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        m = pattern.match(entry.name)
        if m and (_is_dir(entry) if follow else entry.is_dir(follow_symlinks=False)):
            out.append((int(m.group(1)), Path(entry.path)))
    return out


def list_checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-<int>`` directory, newest first; anything else is ignored."""
    return sorted(_scan(output_dir, _CKPT_RE, follow=True), key=lambda sp: sp[0], reverse=True)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """Like ``os.path.isdir`` (what HF's get_last_checkpoint uses): a symlink loop is not a directory, no error."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def select_resume(
    output_dir: str | os.PathLike[str],
    *,
    checksums: bool = True,
    require_commit: bool = True,
    world_size: int | None = None,
    stage: int | None = None,
) -> Selection:
    """The newest checkpoint that verifies, plus a verdict for each newer one that did not.

    Verification reads every file against its recorded checksum unless ``checksums=False`` (sizes only): the
    walk stops at the first checkpoint that verifies, so normally only the newest one is read.

    Incompatible checkpoints (another world size or stage) are rejected and the walk goes on, but they stay in
    ``Selection.incompatible``: the caller should normally refuse the launch instead of resuming from an older
    checkpoint and silently discarding the progress the newer, intact one holds.
    """
    rejected: list[Verdict] = []
    for step, path in list_checkpoints(output_dir):
        v = verify(path, checksums, require_commit=require_commit, world_size=world_size, stage=stage)
        if v.ok:
            return Selection(path, step, v, rejected)
        rejected.append(v)
    return Selection(None, None, None, rejected)


# --------------------------------------------------------------------------------------------------- deletion


def _safe_rmtree(path: Path) -> None:
    """Rename out of the ``checkpoint-<int>`` namespace first, so a crash mid-delete never leaves a half tree
    that resume (ours or HF's ``get_last_checkpoint``) could mistake for a checkpoint."""
    doomed = path.with_name(f"{DELETING_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    _fsync_path(path.parent, directory=True)
    shutil.rmtree(doomed)


def rotate(
    output_dir: str | os.PathLike[str],
    keep: int,
    *,
    protect: Iterable[str | os.PathLike[str]] = (),
    note: Callable[[str], None] = lambda line: None,
) -> list[Path]:
    """Delete old checkpoints, keeping the ``keep`` newest *committed* (and verifying) ones; returns what went.

    Call it on rank 0 right after a successful :func:`write_commit` (HF's own ``save_total_limit`` must be
    off). Torn or uncommitted checkpoints never count toward ``keep``; those older than the newest committed
    one are garbage and are deleted, newer ones are left alone (nothing newer should exist right after a commit;
    if something does, it is not rotation's business). Without any committed checkpoint nothing is deleted.
    ``protect`` paths (e.g. the best model) are never deleted. Leftover ``.deleting-*`` trees from a crash
    during an earlier rotation are removed too. Only ftkit's own checkpoints are ever deleted
    (:func:`written_by_ftkit`); a checkpoint that is a symbolic link loses its name here, never its target's
    data, and ``note`` is told so.

    Checkpoints a restart set aside (``checkpoint-N.rejected-<utc>-<hex>``, :func:`set_aside_newer`) are outside
    the ``checkpoint-<int>`` namespace, so they never count toward ``keep``; each is deleted once a committed
    checkpoint of step N or later exists (the run has redone that progress, so the rejected copy is only dead
    weight on the disk; until then it is kept for a post-mortem). Verification here is by sizes only: the
    checkpoint just committed was hashed a moment ago, and re-reading every kept one after every save would cost
    a full read of the output directory per save.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    out = Path(output_dir)
    for leftover in out.glob(DELETING_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)
    protected = {Path(p).resolve() for p in protect}
    verdicts = [(step, path, verify(path, False, require_commit=True)) for step, path in list_checkpoints(out)]
    committed = [(step, path) for step, path, v in verdicts if v.ok and v.committed]
    if not committed:
        return []
    newest_step = committed[0][0]
    doomed = [path for _, path in committed[keep:]]
    # ftkit's own torn saves only: a checkpoint it did not write is never deleted (nor counted)
    doomed += [
        path
        for step, path, v in verdicts
        if not (v.ok and v.committed) and step < newest_step and written_by_ftkit(path)
    ]
    doomed += [path for step, path in list_set_aside(out) if step <= newest_step]
    removed: list[Path] = []
    for path in sorted(doomed, key=lambda p: (_checkpoint_step(p) or _set_aside_step(p) or 0, p.name)):
        if path.resolve() in protected:
            continue
        if path.is_symlink():  # moved elsewhere and linked back by someone: drop the name, never the data
            target = os.readlink(path)
            os.unlink(path)
            note(f"rotation: unlinked {path.name}, a symbolic link to {target} (the target is left in place)")
        else:
            _safe_rmtree(path)
        step = _checkpoint_step(path)
        if step is not None:
            _save_record(out, step).unlink(missing_ok=True)
        removed.append(path)
    return removed


def _set_aside_step(path: Path) -> int | None:
    m = _SET_ASIDE_RE.match(path.name)
    return int(m.group(1)) if m else None


def list_set_aside(output_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-N.rejected-*`` directory a restart set aside, oldest first."""
    return sorted(_scan(output_dir, _SET_ASIDE_RE, follow=False), key=lambda sp: (sp[0], sp[1].name))


def set_aside_newer(output_dir: str | os.PathLike[str], selection: Selection) -> list[Path]:
    """Rename every checkpoint newer than ``selection.chosen`` to ``checkpoint-N.rejected-<utc>``; returns them.

    Why: the resumed run will save ``checkpoint-N`` again into the *same* directory, and HF writes in place, so
    stale files of the rejected attempt (a stale commit record, another rank's shard) would mix with the new
    save. Renaming gives the new save an empty directory and keeps the evidence for a post-mortem. Call it only
    once the launch is decided (not when refusing because of an incompatible checkpoint).
    """
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    floor = selection.step if selection.step is not None else -1
    moved: list[Path] = []
    for step, path in list_checkpoints(output_dir):
        if step > floor:
            target = path.with_name(f"{path.name}.rejected-{stamp}-{secrets.token_hex(2)}")
            os.rename(path, target)
            moved.append(target)
    if moved:
        _fsync_path(Path(output_dir), directory=True)
    return moved
