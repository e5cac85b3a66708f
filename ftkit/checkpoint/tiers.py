"""Checkpoint tiers on disk: a node-local tier the ranks save to often, the run directory (durable) the copies go to.

A **local checkpoint** is ``<local_dir(host)>/checkpoint-N/`` on every node of the attempt: HF Trainer with
``save_on_each_node`` and DeepSpeed with ``use_node_local_storage`` write the shared files (weights, module states,
trainer state, ``latest``) on each node and each rank's own files (optimizer shard, RNG state) on its node. Each node
has its own commit record (``kind: node``: that node's files only, every byte checksummed); rank 0 then writes a
**set record** in the run directory (``RUN/ftkit/local/checkpoint-N.json``: the step, the attempt and the nodes), the
sign that every node committed its part.

The **durable copy** of step N is assembled in ``RUN/.staging-checkpoint-N/``: each node's agent copies its part
there (the first node also the shared files), hashing every byte as it copies and comparing with the node's record,
then writes its part record (``RUN/.staging-checkpoint-N.parts/<host>.json``). Whoever sees every node's part first
writes the commit record over the whole set (the same check as a direct save: every file covered, the structure
sound) and renames the staging directory to ``RUN/checkpoint-N`` in one step. A copy killed at any moment leaves at
most a staging directory, which no reader ever takes for a checkpoint. A node's local checkpoint is marked
(``.ftkit_durable``) once its step is durable, so the local rotation may drop it.

**Peer copies** (``checkpoint.peer_copies: 1``): each node's agent also copies its committed part to the next node's
tier, under ``peer/<host>/checkpoint-N``, with its node record: a survivor holding its own part and the lost node's
can assemble step N in the run directory (:func:`assemble`) without the lost node. Before it sends step N, an agent
**claims** it in the run directory (``RUN/ftkit/local/peer-claims/<next node>/<host>.json``), and the next node's
rotation keeps its own part of step N meanwhile: a copy that takes longer than a few steps (an ssh connection on a
loaded machine, a large part) still lands beside the part it completes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

import xxhash

from ftkit.checkpoint.checksums import DEFAULT_SPEC, SAMPLED, SampleSpec, recompute_or_error
from ftkit.checkpoint.commit import CommitError, write_commit
from ftkit.checkpoint.directory import list_checkpoints, rotate, written_by_ftkit
from ftkit.checkpoint.layout import (
    COMMIT_FILE,
    DURABLE_MARK,
    PEER_MARK,
    PEER_SENDING,
    _payload_files,
    per_rank,
    read_commit,
    tp_degree,
)
from ftkit.checkpoint.verify import Verdict, verify
from ftkit.errors import PreflightError
from ftkit.rundir.layout import atomic_write, read_metrics
from ftkit.rundir.records import CommitExtra, CommitRecord, FileEntry, MetricsRecord
from ftkit.rundir.spec import LocalTierSpec

SETS_DIR = "ftkit/local"  # RUN/ftkit/local/checkpoint-N.json: every node committed its part of step N
CLAIMS_DIR = f"{SETS_DIR}/peer-claims"  # RUN/ftkit/local/peer-claims/<holder>/<sender>.json: the step being sent
STAGING_PREFIX = ".staging-"  # RUN/.staging-checkpoint-N: a durable copy being assembled
PEER_DIR = "peer"  # <local_dir(host)>/peer/<other host>/checkpoint-N: the previous node's part
COPY_CHUNK = 8 << 20
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_ARRIVING_RE = re.compile(r"^\.checkpoint-(\d+)\.tmp$")  # a peer copy on its way in (copy_to_peer, the ssh send)
_CKPT_PREFIX = re.compile(r"^checkpoint-\d+")  # a checkpoint, or one set aside


def node_dir(template: str, host: str) -> Path:
    """The local tier directory of ``host`` (``{host}`` in the template becomes the node's name)."""
    return Path(template.replace("{host}", host))


# ------------------------------------------------------------------------------------------------ a private place


class TierUnsafe(PreflightError):
    """The node's tier directory, or one above it, is not this user's alone: another local user could read the
    weights, or swap what a resume verifies (exit 3; nothing is written there, nothing removed)."""


TIER_MARK = ".ftkit-tier"  # in every directory ftkit created for a tier: what the end of a launch may remove
# What ftkit (and the Trainer it points there) puts in a node's tier directory; nothing else is ever removed
_TIER_NAMES = re.compile(r"^(checkpoint-\d+.*|\.checkpoint-\d+\.tmp|peer|ftkit|\.deleting-.*|\.ftkit-tier)$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass
class _Opened:
    """One directory of the tier's path, open: its fd, its path, and whether ftkit created it (its mark)."""

    fd: int
    path: Path
    ours: bool


def _judge(o: _Opened, *, own: bool) -> None:
    """A directory above the tier (``own=False``): root's or this user's, and writable by others only when sticky
    (``/dev/shm``, ``/tmp``). The tier's own (``own=True``: the node's directory and those ftkit made): this user's
    and writable by no one else."""
    st = os.fstat(o.fd)
    uid = os.geteuid()
    if st.st_uid != uid and (own or st.st_uid != 0):
        raise TierUnsafe(
            f"{o.path}: owned by uid {st.st_uid}, not by this user (uid {uid}): another local user made it, and could "
            "read or replace the checkpoints saved there; remove it, or set checkpoint.local_dir to a directory of "
            "your own"
        )
    writable = st.st_mode & 0o022
    if writable and (own or not st.st_mode & stat.S_ISVTX):
        raise TierUnsafe(
            f"{o.path}: writable by its group or by others (mode {stat.filemode(st.st_mode)}): another local user "
            "could replace the checkpoints saved there; chmod go-w it, or set checkpoint.local_dir elsewhere"
        )


def _marked(fd: int) -> bool:
    try:
        os.stat(TIER_MARK, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _open_chain(directory: Path, *, create: bool) -> list[_Opened] | None:
    """Every directory from ``/`` down to ``directory``, each opened without following a symbolic link (a link
    above the tier is followed only when root or this user made it, e.g. ``/dev/shm -> /run/shm``) and judged
    (:func:`_judge`); with ``create``, the missing ones are made private (0700) and marked as ftkit's. None when
    ``directory`` does not exist and ``create`` is false. The caller closes the fds."""
    if not directory.is_absolute():
        raise TierUnsafe(f"{directory}: the local tier's directory must be an absolute path (checkpoint.local_dir)")
    chain = [_Opened(os.open("/", _DIR_FLAGS), Path("/"), False)]
    try:
        parts = directory.parts[1:]
        for i, name in enumerate(parts):
            parent, last = chain[-1], i == len(parts) - 1
            path = parent.path / name
            made = False
            try:
                fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent.fd)
            except FileNotFoundError:
                if not create:
                    _close(chain)
                    return None
                try:
                    os.mkdir(name, 0o700, dir_fd=parent.fd)
                    made = True
                except FileExistsError:  # another rank of this node, at this moment
                    pass
                fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent.fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise TierUnsafe(f"{path}: not a directory") from None
                if last or parent.ours or st.st_uid not in (0, os.geteuid()):
                    raise TierUnsafe(
                        f"{path}: a symbolic link (to {os.readlink(name, dir_fd=parent.fd)}, made by uid {st.st_uid}): "
                        "the local tier never follows one it did not make; remove it"
                    ) from None
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent.fd)
            o = _Opened(fd, path, False)
            chain.append(o)
            if made:
                mark = os.open(TIER_MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
                os.close(mark)
            o.ours = _marked(fd)
            _judge(o, own=last or o.ours)
        node = chain[-1]
        if os.fstat(node.fd).st_mode & 0o077:
            os.fchmod(node.fd, 0o700)  # this user's (judged above): private, whatever made it
        return chain
    except BaseException:
        _close(chain)
        raise


def _close(chain: list[_Opened]) -> None:
    for o in chain:
        os.close(o.fd)


def open_tier(template: str, host: str, *, create: bool = True) -> Path | None:
    """The node's tier directory, checked (made, with ``create``) private to this user: :class:`TierUnsafe` names
    what is wrong. Every part of its path is then root's or this user's and replaceable by no one else, so it is
    used by name from here on. None when it does not exist (``create=False``). Every rank at its start, every
    agent before it verifies a part (at every resume), and the supervisor before every attempt call it."""
    chain = _open_chain(node_dir(template, host), create=create)
    if chain is None:
        return None
    _close(chain)
    return node_dir(template, host)


def remove_tier(template: str, host: str) -> list[str]:
    """The end of a launch on one node: what ftkit put in the node's tier directory (checkpoints, peer copies, its
    records) is removed, then every directory ftkit created for it (marked) once nothing else is in it, from the
    node's up; a directory ftkit did not create is kept, as is anything ftkit did not write. Nothing is followed:
    a link is removed as a link. Returns what was kept (directories with other content), [] when all went.
    :class:`TierUnsafe` when the path is not this user's alone: then nothing is removed."""
    chain = _open_chain(node_dir(template, host), create=False)
    if chain is None:
        return []
    try:
        node = chain[-1]
        _remove_written(node)
        kept: list[str] = []
        for parent, o in reversed(list(zip(chain, chain[1:], strict=False))):
            left = [n for n in os.listdir(o.fd) if n != TIER_MARK]
            if not o.ours:  # the user's own directory (or one an older ftkit made): emptied of ftkit's, kept
                if o is node and left:
                    kept.append(f"{o.path} (not made by ftkit; holds {', '.join(sorted(left)[:3])})")
                break
            if left:
                kept.append(f"{o.path} (holds {', '.join(sorted(left)[:3])})")
                break
            os.unlink(TIER_MARK, dir_fd=o.fd)
            try:
                os.rmdir(o.path.name, dir_fd=parent.fd)
            except OSError:  # something arrived meanwhile (another node's directory on a shared file system)
                kept.append(str(o.path))
                break
        return kept
    finally:
        _close(chain)


def _remove_written(node: _Opened) -> None:
    """What ftkit wrote in the node's tier directory: in one ftkit made (marked), everything of ftkit's names; in the
    user's own, only what is verifiably ftkit's (checkpoints with a commit or save record, peer copies with their
    record, its save records, its hidden work names) and the directories of its names that this leaves empty.
    Checkpoints first: a save record says whose a checkpoint is."""
    names = sorted(os.listdir(node.fd), key=lambda n: n in ("ftkit", "peer"))
    for name in names:
        if not _TIER_NAMES.match(name) or name == TIER_MARK:
            continue
        st = os.stat(name, dir_fd=node.fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            if node.ours or name.startswith("."):
                os.unlink(name, dir_fd=node.fd)  # a link goes as a link
            continue
        path = node.path / name
        if node.ours or name.startswith(".") or (_CKPT_PREFIX.match(name) and written_by_ftkit(path)):
            shutil.rmtree(name, dir_fd=node.fd)
        elif name == "peer":
            for src in [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]:
                for p in src.iterdir():
                    if (_CKPT_RE.match(p.name) and (p / COMMIT_FILE).is_file()) or _ARRIVING_RE.match(p.name):
                        shutil.rmtree(p, ignore_errors=True)
                _rmdir_if_empty(src)
            _rmdir_if_empty(path)
        elif name == "ftkit":
            for p in (path / "saves").glob("checkpoint-*.json"):
                p.unlink(missing_ok=True)
            _rmdir_if_empty(path / "saves")
            _rmdir_if_empty(path)


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def resume_path(template: str, step: int) -> str:
    """What every rank of a resumed attempt is told to resume from: one string for all nodes, each rank replacing
    ``{host}`` with its own node (:func:`for_node`)."""
    return f"{template.rstrip('/')}/checkpoint-{step}"


def for_node(path: str, host: str) -> str:
    return path.replace("{host}", host)


def files_on_node(ckpt: str | os.PathLike[str], rank: int, first_rank_of_node: int) -> list[str]:
    """What ``rank`` checksums in its node's local checkpoint: its own files, and the shared ones when it is the
    node's first rank."""
    out = []
    files = _payload_files(Path(ckpt))
    tp = tp_degree(files)
    for rel in files:
        owner = per_rank(rel, tp)
        if owner == rank or (owner is None and rank == first_rank_of_node):
            out.append(rel)
    return out


# ------------------------------------------------------------------------------------------------ set records


class SetRecord(TypedDict, total=False):
    """``RUN/ftkit/local/checkpoint-N.json``: every node committed its part of step N on its local tier."""

    step: int
    attempt: int
    nodes: list[str]
    world_size: int
    stop: bool | None


def write_set_record(
    run_dir: str | os.PathLike[str], step: int, *, attempt: int, nodes: list[str], world_size: int, stop: bool | None
) -> None:
    """Rank 0, once every node committed its part of ``step`` (after a barrier)."""
    path = Path(run_dir) / SETS_DIR / f"checkpoint-{step}.json"
    record = SetRecord(step=step, attempt=attempt, nodes=nodes, world_size=world_size, stop=stop)
    atomic_write(path, json.dumps(record), sync_dir=True)


def set_records(run_dir: str | os.PathLike[str]) -> list[SetRecord]:
    """Every set record, newest step first."""
    out = []
    d = Path(run_dir) / SETS_DIR
    for p in d.glob("checkpoint-*.json") if d.is_dir() else []:
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(cast("SetRecord", rec))
    return sorted(out, key=lambda r: -r["step"])


def prune_set_records(
    run_dir: str | os.PathLike[str], keep: int, durable_every: int, protect: Iterable[int] = ()
) -> None:
    """Set records a resume can no longer use: older than the run directory's newest durable step, or neither among
    the ``keep`` newest nor due in the run directory nor in ``protect`` (steps kept for peer copies,
    :func:`peer_protected`): the local tiers rotated them away."""
    durable = newest_durable(run_dir)
    keep_steps = set(protect)
    for i, rec in enumerate(set_records(run_dir)):
        step = rec["step"]
        due = step % durable_every == 0 or rec.get("stop") or step in keep_steps
        if (durable is not None and step < durable) or (i >= keep and not due):
            try:
                (Path(run_dir) / SETS_DIR / f"checkpoint-{step}.json").unlink()
            except OSError:
                pass


def due_in_run_dir(rec: SetRecord, tier: LocalTierSpec) -> bool:
    """A step the recipe asks to be durable: every ``train.save_steps``, and a graceful stop's save."""
    return rec["step"] % tier["durable_steps"] == 0 or bool(rec.get("stop"))  # train.save_steps: at least 1


def flush_due(run_dir: str | os.PathLike[str], tier: LocalTierSpec) -> list[SetRecord]:
    """What the end of a launch copies from the local tier, oldest first: every step every node committed that is
    due in the run directory (:func:`due_in_run_dir`) and not there yet, and the newest step the run directory
    lacks. Only the newest was copied when the background copies lagged: a 12-step run saving every 5 kept
    checkpoint-5 and -12, never -10."""
    run = Path(run_dir)
    durable = newest_durable(run)
    later = [r for r in set_records(run) if durable is None or r["step"] > durable]
    if not later:
        return []
    missing = [r for r in later if not (run / f"checkpoint-{r['step']}" / COMMIT_FILE).is_file()]
    wanted = [r for r in missing if due_in_run_dir(r, tier)]
    if later[0] in missing and later[0] not in wanted:
        wanted.append(later[0])
    return sorted(wanted, key=lambda r: r["step"])


def flush_part(run_dir: Path, directory: Path, host: str, step: int) -> tuple[bool, str | None, bool]:
    """This node's part of ``step`` (in its tier ``directory``) copied to the run directory now, verified first;
    the step is published when every node's part is there. (ok, why not, published by this call)."""
    v = verify_part(directory / f"checkpoint-{step}")
    if not v.ok:
        return False, v.reason, False
    copy_to_durable(run_dir, NodePart(host, step, directory / f"checkpoint-{step}", v.record or {}))
    return True, None, publish(run_dir, step, v.record or {}) is not None


def clear_set_records(run_dir: str | os.PathLike[str]) -> None:
    shutil.rmtree(Path(run_dir) / SETS_DIR, ignore_errors=True)


def newest_durable(run_dir: str | os.PathLike[str]) -> int | None:
    """The newest step the run directory holds with a commit record (sizes are not checked here)."""
    for step, path in list_checkpoints(run_dir):
        if (path / COMMIT_FILE).is_file():
            return step
    return None


def local_checkpoints(directory: Path) -> list[tuple[int, Path, CommitRecord]]:
    """``(step, path, record)`` of the committed checkpoints in one node's tier directory, newest first."""
    out = []
    for step, path in list_checkpoints(directory):
        try:
            rec = read_commit(path)
        except (OSError, ValueError):
            continue
        if rec is not None:
            out.append((step, path, rec))
    return out


def rotate_local(
    directory: Path, keep: int, durable_every: int, durable_step: int | None, claimed: Iterable[int] = ()
) -> list[Path]:
    """Keep the ``keep`` newest committed local checkpoints, any whose step is due in the run directory (a
    multiple of ``durable_every``, or a stop's save) and not yet there, and those a peer copy pairs with
    (:func:`peer_protected`, and the steps ``claimed`` by the previous node's copy under way, :func:`peer_claims`).
    Torn saves older than the newest go."""
    protect = []
    paired = peer_protected(directory) | set(claimed)
    for step, path, rec in local_checkpoints(directory):
        due = step % durable_every == 0 or (rec.get("extra") or {}).get("stop")
        if step in paired or (
            due and not (path / DURABLE_MARK).exists() and (durable_step is None or step > durable_step)
        ):
            protect.append(path)
    return rotate(directory, keep, protect=protect)


def peer_protected(directory: Path) -> set[int]:
    """Steps of this node's own parts a lost node's recovery needs: the one being copied to the next node
    (:data:`PEER_SENDING`) and the newest copied there (:data:`PEER_MARK`), and the newest peer copy held here of
    each other node plus any arriving (``.checkpoint-N.tmp``): this node's own part completes those sets."""
    steps = set()
    marked = []
    for step, path in list_checkpoints(directory):
        if (path / PEER_SENDING).exists():
            steps.add(step)
        if (path / PEER_MARK).exists():
            marked.append(step)
    if marked:
        steps.add(max(marked))
    held = directory / PEER_DIR
    for src in held.iterdir() if held.is_dir() else []:
        copies = peer_parts(directory, src.name)
        if copies:
            steps.add(copies[0][0])
        for p in src.iterdir():
            m = _ARRIVING_RE.match(p.name)
            if m:
                steps.add(int(m.group(1)))
    return steps


def claim_peer_copy(run_dir: str | os.PathLike[str], sender: str, holder: str, step: int) -> None:
    """``sender`` is about to copy its part of ``step`` to ``holder``: ``holder``'s rotation keeps its own part of
    that step from now on (until the sender claims a newer one). Written before the copy starts, in the run
    directory every node reads, so no connection to ``holder`` has to be made first."""
    atomic_write(Path(run_dir) / CLAIMS_DIR / holder / f"{sender}.json", json.dumps({"step": step}))


def peer_claims(run_dir: str | os.PathLike[str], holder: str) -> set[int]:
    """The steps the other nodes claimed for copies to ``holder`` (:func:`claim_peer_copy`)."""
    out = set()
    d = Path(run_dir) / CLAIMS_DIR / holder
    for p in d.glob("*.json") if d.is_dir() else []:
        try:
            step = json.loads(p.read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(step, int):
            out.add(step)
    return out


def clear_peer_claims(run_dir: str | os.PathLike[str]) -> None:
    """Before an attempt (no agent is copying): the claims are an earlier attempt's."""
    shutil.rmtree(Path(run_dir) / CLAIMS_DIR, ignore_errors=True)


def rotate_peer_copies(directory: Path) -> list[Path]:
    """Keep the newest committed peer copy of each node held here; older ones (and torn ones older than it) go.
    Copies still arriving (``.checkpoint-N.tmp``) are the sender's business."""
    removed = []
    held = directory / PEER_DIR
    for src in held.iterdir() if held.is_dir() else []:
        copies = peer_parts(directory, src.name)
        if not copies:
            continue
        newest = copies[0][0]
        for p in src.iterdir():
            m = _CKPT_RE.match(p.name)
            if m and int(m.group(1)) < newest:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def discard_newer(directory: Path, step: int | None) -> list[Path]:
    """A resume from ``step`` (None: from scratch) makes every local part and peer copy of a later step stale: an
    earlier attempt's, perhaps at another world size. The new attempt saves those steps again."""
    gone = []
    dirs = [directory] + ([p for p in (directory / PEER_DIR).iterdir()] if (directory / PEER_DIR).is_dir() else [])
    for d in dirs:
        for p in d.iterdir() if d.is_dir() else []:
            m = _CKPT_RE.match(p.name)
            if m and (step is None or int(m.group(1)) > step):
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p)
    return gone


def discard_set_records_newer(run_dir: str | os.PathLike[str], step: int | None) -> None:
    for rec in set_records(run_dir):
        if step is None or rec["step"] > step:
            try:
                (Path(run_dir) / SETS_DIR / f"checkpoint-{rec['step']}.json").unlink()
            except OSError:
                pass


# ------------------------------------------------------------------------------------------------ copying


class CopyError(Exception):
    """A file read back differs from the node's record: the local part is torn, nothing may be published."""


def copy_part(
    src: Path,
    dst: Path,
    files: Mapping[str, FileEntry],
    record: CommitRecord | None = None,
    after_file: Callable[[str], None] | None = None,
    private: bool = False,
) -> dict[str, FileEntry]:
    """Copy ``files`` (relative path -> the node record's entry) from ``src`` to ``dst``, hashing every byte as it
    is copied and comparing with the entry; each file is fsynced. Returns the entries (for the part record).
    ``after_file`` is called with each file copied (the agent's test-only pause). ``private``: into another node's
    tier (a peer copy): files 0600, directories 0700, no link followed."""
    out: dict[str, FileEntry] = {}
    for rel, entry in sorted(files.items()):
        s, d = src / rel, dst / rel
        if private:
            d.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        else:
            d.parent.mkdir(parents=True, exist_ok=True)
        expected = str(entry["checksum"])
        algo = expected.split(":", 1)[0]
        h = xxhash.xxh3_128() if algo == "xxh3_128" else None
        size = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (os.O_NOFOLLOW if private else 0)
        with open(s, "rb") as fi, open(os.open(d, flags, 0o600 if private else 0o666), "wb") as fo:
            while chunk := fi.read(COPY_CHUNK):
                if h is not None:
                    h.update(chunk)
                fo.write(chunk)
                size += len(chunk)
            fo.flush()
            os.fsync(fo.fileno())
        digest = f"{algo}:{h.hexdigest()}" if h is not None else _other(d, expected, record)
        if size != int(entry["size"]) or digest != expected:
            raise CopyError(f"{rel}: {size} bytes, {digest} read from {s}; the node's record says {entry}")
        out[rel] = FileEntry(size=size, checksum=expected, rank=int(entry.get("rank", 0)))
        if after_file is not None:
            after_file(rel)
    return out


def _other(path: Path, expected: str, record: CommitRecord | None) -> str:
    """A checksum of another algorithm (sampled, blake2b): recomputed from the copy with the record's parameters."""
    spec = DEFAULT_SPEC
    if record is not None and expected.startswith(SAMPLED + ":"):
        spec = SampleSpec.from_json(record["checksum"])
    return recompute_or_error(path, expected, spec)


def make_private(path: Path) -> None:
    """Files 0600 and directories 0700 under ``path`` (a checkpoint in a node's tier: the full weights), links left
    alone. The tier's directory is private already; this is the second wall."""
    for here, dirs, files in os.walk(path):
        for name, mode in [(d, 0o700) for d in dirs] + [(f, 0o600) for f in files]:
            p = os.path.join(here, name)
            if not os.path.islink(p):
                os.chmod(p, mode)
    os.chmod(path, 0o700)


def _staging(run_dir: Path, step: int) -> Path:
    return run_dir / f"{STAGING_PREFIX}checkpoint-{step}"


def _parts_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"{STAGING_PREFIX}checkpoint-{step}.parts"


def clear_staging(run_dir: str | os.PathLike[str]) -> None:
    """Copies no agent is making any more (between attempts): a staging directory is never a checkpoint."""
    for p in Path(run_dir).glob(STAGING_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)


@dataclass(frozen=True)
class NodePart:
    """One node's committed part of a local checkpoint, as its agent finds it."""

    host: str
    step: int
    path: Path
    record: CommitRecord

    @property
    def nodes(self) -> list[str]:
        return list((self.record.get("extra") or {}).get("nodes") or [self.host])

    def files(self, with_shared: bool) -> dict[str, FileEntry]:
        files = self.record.get("files") or {}
        tp = tp_degree(files)
        return {rel: entry for rel, entry in files.items() if with_shared or per_rank(rel, tp) is not None}


def copy_to_durable(
    run_dir: Path, part: NodePart, after_file: Callable[[str], None] | None = None
) -> dict[str, FileEntry]:
    """This node's part of ``part.step`` into the staging directory (the first node also copies the shared files),
    then its part record. Returns what was copied."""
    first = part.nodes[0] == part.host
    copied = copy_part(part.path, _staging(run_dir, part.step), part.files(with_shared=first), part.record, after_file)
    atomic_write(
        _parts_dir(run_dir, part.step) / f"{part.host}.json",
        json.dumps({"host": part.host, "files": copied}),
        sync_dir=True,
    )
    return copied


def publish(run_dir: Path, step: int, record: CommitRecord) -> Path | None:
    """When every node's part of ``step`` is in the staging directory: the commit record over the whole set, then
    the rename to ``checkpoint-<step>``. None while parts are missing, or when another agent published first."""
    nodes = list((record.get("extra") or {}).get("nodes") or [])
    parts_dir = _parts_dir(run_dir, step)
    parts = []
    for host in nodes:
        try:
            parts.append(json.loads((parts_dir / f"{host}.json").read_text())["files"])
        except (OSError, ValueError, KeyError):
            return None
    final = run_dir / f"checkpoint-{step}"
    if (final / COMMIT_FILE).is_file():
        return None
    try:
        os.mkdir(parts_dir / "publishing")  # one publisher: mkdir is atomic, on NFS too
    except FileExistsError:
        return None
    staging = _staging(run_dir, step)
    extra = CommitExtra(**(record.get("extra") or {}))
    extra["tier"] = "durable"
    extra.pop("node", None)
    extra.pop("ranks", None)
    try:
        write_commit(
            staging,
            parts,
            step=step,
            world_size=int(record["world_size"]),
            stage=record.get("stage"),
            recipe_hash=str(record.get("recipe_hash", "")),
            extra=extra,
        )
    except CommitError:
        shutil.rmtree(parts_dir / "publishing", ignore_errors=True)
        raise
    if final.exists():  # an uncommitted leftover of this step (a torn direct save): ftkit's own, set aside
        final.rename(final.with_name(f"{final.name}.rejected-staged"))
        shutil.rmtree(final.with_name(f"{final.name}.rejected-staged"), ignore_errors=True)
    os.rename(staging, final)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return final


def copy_to_peer(part: NodePart, peer_tier: Path, send: Callable[[Path, Path], None] | None = None) -> Path:
    """This node's committed part (files and node record) into the next node's tier as ``peer/<host>/``. ``send``
    copies a directory to another host (ssh); None: the peer's tier is a path here."""
    dst = peer_tier / PEER_DIR / part.host / f"checkpoint-{part.step}"
    if send is not None:
        send(part.path, dst)
        return dst
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    copy_part(part.path, tmp, part.record.get("files") or {}, part.record, private=True)
    shutil.copyfile(part.path / COMMIT_FILE, tmp / COMMIT_FILE, follow_symlinks=False)
    os.chmod(tmp / COMMIT_FILE, 0o600)
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(tmp, dst)
    return dst


def peer_parts(tier: Path, host: str) -> list[tuple[int, Path]]:
    """``(step, path)`` of the committed peer copies of ``host``'s parts held in ``tier``, newest first."""
    d = tier / PEER_DIR / host
    out = []
    for p in d.iterdir() if d.is_dir() else []:
        m = _CKPT_RE.match(p.name)
        if m and (p / COMMIT_FILE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def verify_part(path: Path, checksums: bool = True) -> Verdict:
    return verify(path, checksums, require_commit=True)


def assemble(run_dir: Path, parts: Iterable[NodePart]) -> Path | None:
    """Step N into the run directory from parts held here (this node's own and the peer copies it keeps)."""
    parts = list(parts)
    record = parts[0].record
    for part in parts:
        copy_to_durable(run_dir, part)
    return publish(run_dir, parts[0].step, record)


def durable_progress(run_dir: Path) -> list[MetricsRecord]:
    """The commit records of the run's metrics.jsonl that the agents wrote (durable copies), oldest first."""
    return [m for m in read_metrics(Path(run_dir) / "metrics.jsonl") if m.get("event") == "durable"]
