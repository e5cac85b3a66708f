"""The checkpoints of one output directory: which are ftkit's (a record that it began each save), the newest one
that verifies (resume), rotation of old and torn ones (only ftkit's own), and setting newer torn ones aside so a
resumed run can write that step again."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ftkit.checkpoint.layout import (
    _CKPT_RE,
    _SET_ASIDE_RE,
    COMMIT_FILE,
    DELETING_PREFIX,
    SAVES_DIR,
    _checkpoint_step,
    _fsync_path,
)
from ftkit.checkpoint.verify import Verdict, verify
from ftkit.rundir.layout import atomic_write


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


def _save_record(output_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(output_dir) / SAVES_DIR / f"checkpoint-{step}.json"


def record_save_begun(output_dir: str | os.PathLike[str], step: int, attempt: int) -> None:
    """Every rank, before the Trainer writes ``checkpoint-<step>``: this save is ftkit's (see :data:`SAVES_DIR`).
    Written atomically and durably; several ranks writing the same record is harmless (the same content)."""
    atomic_write(_save_record(output_dir, step), json.dumps({"step": step, "attempt": attempt}), sync_dir=True)


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
    found = [(step, p) for step, p in list_checkpoints(output_dir) if not written_by_ftkit(p)]
    return [p for _, p in sorted(found, key=lambda sp: sp[0])]


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
