"""What a checkpoint directory holds, by name: HF Trainer + DeepSpeed's (or FSDP2's DCP) files, which rank writes
which, the commit record's name and format, DeepSpeed's ``latest`` tag, and the structural check of a checkpoint
without a record. Standard library only (the supervisor on the head node and every rank import it)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from ftkit.rundir.records import CommitRecord

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


# DeepSpeed's model-parallel (AutoTP) rank in a shard's name: zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt,
# mp_rank_{mp:02d}_model_states.pt. Under tensor parallelism the global rank is dp * tp + mp (DeepSpeed's
# (data_parallel, tensor_parallel) mesh, row-major: a TP group is consecutive ranks).
_MP_RANK_RE = re.compile(r"(?:^|_)mp_rank_(\d+)_")


_RNG_RANK_RE = re.compile(r"^rng_state_(\d+)\.pth$")


_ACCELERATE_RNG_RE = re.compile(r"^random_states_(\d+)\.pkl$")  # Accelerator.save_state, one per process


_OFFLOAD_RANK_RE = re.compile(r"^rank(\d+)$")  # global_stepN/offloaded_tensors/rank00/ (NVMe offload)


_DCP_RANK_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # torch.distributed.checkpoint: each rank's own files


DCP_METADATA = ".metadata"  # written by DCP's coordinator (rank 0) once every rank's files are written


_DCP_DIR_RE = re.compile(r"^(pytorch_model_fsdp|optimizer)_\d+$")  # HF Trainer's FSDP sharded state dicts


_TAG_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


_MANIFEST_THREADS = 4  # per rank; several ranks share a node's cores


# A record per save ftkit began, written by every rank before the Trainer writes a byte of checkpoint-N: an
# uncommitted checkpoint with one is ftkit's own torn save (set aside, rotated away); without one it was written
# by something else (a plain HF Trainer run, a copy) and ftkit never resumes from it, moves it or deletes it.
SAVES_DIR = "ftkit/saves"  # relative to the output (run) directory
DURABLE_MARK = ".ftkit_durable"  # in a local-tier checkpoint: its step is durable in the run directory (bookkeeping)
PEER_MARK = ".ftkit_peer_copied"  # in a local-tier checkpoint: the next node holds a copy of this part (bookkeeping)
PEER_SENDING = ".ftkit_peer_sending"  # ... a copy of it to the next node is under way (rotation keeps it meanwhile)


def _is_bookkeeping(rel: str) -> bool:
    """Files that are not part of the checkpoint payload: our own record and temp files, NFS silly-renames."""
    name = rel.rsplit("/", 1)[-1]
    if (
        rel == COMMIT_FILE
        or (name == rel and name.startswith(_TMP_PREFIX))
        or rel in (DURABLE_MARK, PEER_MARK, PEER_SENDING)
    ):
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


def _writer_rank(rel: str, tp: int = 1) -> int:
    """The rank that writes ``rel`` in HF Trainer + DeepSpeed's layout; 0 for everything not per-rank."""
    rank = per_rank(rel, tp)
    return 0 if rank is None else rank


def tp_degree(rels: Iterable[str]) -> int:
    """The tensor-parallel degree a checkpoint was saved with: DeepSpeed AutoTP names each TP rank's shards
    ``mp_rank_{mp:02d}``; 1 when every shard is ``mp_rank_00`` (data parallelism alone)."""
    ranks = [int(m.group(1)) for rel in rels if (m := _MP_RANK_RE.search(rel.rsplit("/", 1)[-1]))]
    return max(ranks, default=0) + 1


def per_rank(rel: str, tp: int = 1) -> int | None:
    """The rank a file belongs to when it is one rank's own (RNG state, ZeRO shard, NVMe-offloaded tensors); None for
    the shared files every node holds. ``tp``: the checkpoint's tensor-parallel degree (:func:`tp_degree`), under
    which a ZeRO shard belongs to rank ``dp * tp + mp`` and ``mp_rank_{mp}_model_states.pt`` to rank ``mp``, the first
    data-parallel rank of that TP rank's group, which writes it."""
    parts = rel.split("/")
    name = parts[-1]
    if m := _RNG_RANK_RE.match(name) or _ACCELERATE_RNG_RE.match(name):
        return int(m.group(1))
    if m := _ZERO_RANK_RE.search(name):
        mp = _MP_RANK_RE.search(name) if tp > 1 else None
        return int(m.group(1)) * tp + (int(mp.group(1)) if mp else 0)
    if tp > 1 and len(parts) > 1 and (m := _MP_RANK_RE.match(name)):
        return int(m.group(1))
    if len(parts) > 1 and (m := _DCP_RANK_RE.match(name)):
        return int(m.group(1))
    for i, comp in enumerate(parts[:-2]):
        if comp == "offloaded_tensors" and (m := _OFFLOAD_RANK_RE.match(parts[i + 1])):
            return int(m.group(1))
    return None


_WEIGHTS_RE = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|gguf)$")  # tensors, in the formats models are saved in


def model_weights(directory: str | os.PathLike[str]) -> list[str]:
    """The weight files a saved model directory holds (``model.safetensors`` and its shards, ``pytorch_model.bin``,
    ``adapter_model.safetensors``, a custom loop's ``model.pt``, ...; not HF's ``training_args.bin``); [] when
    none: a save that wrote only the tokenizer and config."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if _WEIGHTS_RE.search(n) and n != "training_args.bin")


def reshards(files: Iterable[str]) -> bool:
    """Whether a checkpoint of these files (relative paths) loads on any world size: FSDP2's DCP state dicts do
    (torch.distributed.checkpoint reshards on load); DeepSpeed's ZeRO shards need the same world size (or a universal
    conversion)."""
    return any(
        "/" in rel and rel.split("/", 1)[1] == DCP_METADATA and _DCP_DIR_RE.match(rel.split("/", 1)[0]) for rel in files
    )


def files_owned_by_rank(ckpt_dir: str | os.PathLike[str], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` checksums: the ones it wrote, so the cost is spread like the save itself.

    ``zero_pp_rank_{r}_...`` (ZeRO shards), ``__{r}_N.distcp`` (FSDP2's DCP shards), ``rng_state_{r}.pth`` and NVMe
    ``offloaded_tensors/rank{r}/`` belong to rank r; everything else (model weights, ``latest``,
    ``mp_rank_00_model_states.pt``, DCP's ``.metadata``, scheduler, ``trainer_state.json``, ...) to rank 0. A file
    naming a rank >= ``world_size`` belongs to nobody: it is a leftover from a run with more ranks, and
    :func:`write_commit` then refuses because it is not covered.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    files = _payload_files(Path(ckpt_dir))
    tp = tp_degree(files)
    return [rel for rel in files if _writer_rank(rel, tp) == rank]


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


def _checkpoint_step(path: Path) -> int | None:
    m = _CKPT_RE.match(path.name)
    return int(m.group(1)) if m else None


def read_commit(ckpt_dir: str | os.PathLike[str]) -> CommitRecord | None:
    """The commit record as a dict, or None when there is none. Raises ValueError when it does not parse."""
    path = Path(ckpt_dir) / COMMIT_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    record = json.loads(raw)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return cast("CommitRecord", record)


@dataclass
class _Structure:
    problem: str | None = None
    tag: str | None = None
    world_size: int | None = None  # inferred from DeepSpeed's optimizer shards, when there are any
    stage3: bool | None = None  # zero_pp_rank_*_model_states.pt exist only at stage 3
    reshards: bool = False  # DCP (FSDP2's sharded state dicts): loads on any world size, no conversion


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

    dcp_dirs = sorted({rel.split("/", 1)[0] for rel in files if "/" in rel and _DCP_DIR_RE.match(rel.split("/")[0])})
    if dcp_dirs:
        st.reshards = True
        ranks: set[int] = set()
        for d in dcp_dirs:
            names = [rel[len(d) + 1 :] for rel in files if rel.startswith(d + "/")]
            if DCP_METADATA not in names:
                st.problem = f"{d}/{DCP_METADATA} missing (the sharded save did not finish)"
                return st
            shard_ranks = sorted({int(m.group(1)) for n in names if (m := _DCP_RANK_RE.match(n))})
            if shard_ranks != list(range(len(shard_ranks))) or (ranks and set(shard_ranks) != ranks):
                st.problem = f"{d}/ has shards of ranks {shard_ranks}, expected 0..{max(len(ranks), 1) - 1}"
                return st
            ranks = set(shard_ranks)
        st.problem = _rng_problem(
            rng_ranks, has_single_rng, len(ranks), f"{dcp_dirs[0]}/ has shards of {len(ranks)} ranks"
        )
        return st
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
        tp = tp_degree(names)
        optim_ranks = sorted(r for n in optim if (r := per_rank(n, tp)) is not None)
        if optim and optim_ranks != list(range(len(optim))):
            st.problem = f"{tag}/ optimizer shards for ranks {optim_ranks}, expected 0..{len(optim) - 1}"
            return st
        zero3_model = sorted(r for n in model_states if _ZERO_RANK_RE.search(n) and (r := per_rank(n, tp)) is not None)
        st.stage3 = bool(zero3_model)
        if zero3_model and zero3_model != (optim_ranks or list(range(len(zero3_model)))):
            st.problem = f"{tag}/ model-state shards for ranks {zero3_model} but optimizer shards for {optim_ranks}"
            return st
        tp_model = sorted({int(m.group(1)) for n in model_states if (m := _MP_RANK_RE.search(n))})
        if tp > 1 and tp_model != list(range(tp)):
            missing = sorted(set(range(tp)) - set(tp_model))
            st.problem = f"{tag}/ has tensor-parallel shards of {tp} ranks but no model states of mp rank {missing[0]}"
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
