"""Choose where an attempt resumes from (read-only): the first step of resume selection
(:mod:`ftkit.supervise.resume`).

Checkpoints are walked newest first and the first whose commit record verifies (every byte, by default) is taken.
A checkpoint of another world size or stage is refused, unless the supervisor itself shrank the job (then it is
converted to DeepSpeed's universal format); a run whose checkpoints were all complete once but none verifies now
refuses to start over; a checkpoint past ``train.max_steps`` refuses too, and so does a directory holding
checkpoints ftkit did not write (it never resumes from, moves or deletes them). A run whose ``final/`` is committed
for the recipe's step limits is finished: nothing is started. Nothing is written here:
:meth:`ftkit.supervise.resume.Resumer.apply` carries the choice out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ftkit.checkpoint.directory import Selection, foreign_checkpoints, select_resume
from ftkit.checkpoint.verify import verify
from ftkit.errors import ExitCode
from ftkit.rundir.layout import RunDir
from ftkit.rundir.records import CommitRecord


@dataclass
class Choice:
    """The outcome of :func:`select`: where to resume from (None: fresh), or why the run cannot go on."""

    selection: Selection | None
    resume: str | None = None
    step: int | None = None
    record: CommitRecord | None = None
    exit_code: int | None = None
    refusal: str | None = None  # one line: why exit_code
    convert: bool = False  # resume needs a universal conversion of an incompatible checkpoint (after a shrink)
    finished: str | None = None  # the run already finished as the recipe asks (one line: where): nothing to do


def foreign_refusal(rd: RunDir) -> str | None:
    """One line when the run directory holds checkpoints ftkit did not write (it never resumes from, moves or
    deletes them), else None. Read-only and cheap: no checkpoint is verified."""
    foreign = foreign_checkpoints(rd.path)
    if not foreign:
        return None
    names = ", ".join(p.name for p in foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
    return (
        f"{rd.path} holds {names}, which ftkit did not write (no commit record, no record of ftkit beginning the "
        f"save): ftkit never resumes from, moves or deletes them; move them out of {rd.path}, or set another "
        "train.output_dir"
    )


def space_refusal(rd: RunDir, choice: Choice) -> str | None:
    """One line when the run directory has less free space than the checkpoint resumed from took (the next save
    needs about as much), else None: starting would only end at the next save with a full disk."""
    import shutil

    files = ((choice.record or {}).get("files") or {}) if choice.resume else {}
    need = sum(int(e.get("size", 0)) for e in files.values() if isinstance(e, dict))
    if not need:
        return None
    try:
        free = shutil.disk_usage(rd.path).free
    except OSError:
        return None
    if free >= need:
        return None
    return (
        f"only {_size(free)} free in {rd.path}, and {Path(choice.resume or '').name} took {_size(need)}: the next "
        "save would fill the disk; free space (committed checkpoints are intact) or move train.output_dir"
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class StepLimits:
    """How long the recipe asks to train: ``train.max_steps`` (None: by epochs) and ``train.epochs``."""

    max_steps: int | None
    epochs: float | None


def finished(rd: RunDir, limits: StepLimits, newest: int | None) -> str | None:
    """Where the run already finished (``final/`` committed for these step limits, nothing newer), else None.
    A relaunch with a raised limit is not finished (it continues from the newest checkpoint)."""
    v = verify(rd.final, checksums=False, require_commit=True)
    if not (v.ok and v.committed) or v.step is None or (newest is not None and newest > v.step):
        return None
    # the limits the final model was trained for, as its commit record's fingerprint holds the recipe (by key)
    recorded = (((v.record or {}).get("extra") or {}).get("fingerprint") or {}).get("recipe") or {}
    if recorded:
        same = recorded.get("train.max_steps") == limits.max_steps and recorded.get("train.epochs") == limits.epochs
    else:  # a final model from an ftkit that recorded no fingerprint: only a step limit can tell
        same = limits.max_steps is not None and v.step >= limits.max_steps
    if not same:
        return None
    return f"final/ committed at step {v.step}"


def select(
    rd: RunDir,
    *,
    checksums: bool,
    world_size: int,
    stage: int,
    max_steps: int | None,
    convert_from_world: int | None = None,
    limits: StepLimits | None = None,
) -> Choice:
    """The checkpoint to resume from, or why the run cannot continue. ``convert_from_world``: after a shrink,
    checkpoints of that world size are converted rather than refused. ``limits`` (the recipe's step limits now):
    given, a run that already finished for them is reported as such."""
    refusal = foreign_refusal(rd)
    if refusal is not None:
        return Choice(None, exit_code=ExitCode.USAGE, refusal=refusal)
    sel = select_resume(
        rd.path,
        checksums=checksums,
        require_commit=True,
        world_size=world_size,
        stage=stage,
    )
    incompatible = sel.incompatible
    if incompatible and convert_from_world is not None:
        newest = max(v.step or -1 for v in incompatible)
        if sel.step is None or newest > sel.step:
            return Choice(sel, convert=True)
        incompatible = []
    if incompatible:
        v = incompatible[0]
        return Choice(
            sel,
            exit_code=ExitCode.NO_CHECKPOINT,
            refusal=f"{v.reason}; ftkit converts a checkpoint to DeepSpeed's universal format only when it "
            "continues a running job on fewer hosts itself (cluster.min_nodes): launch with the original "
            "cluster, or use a new train.output_dir",
        )
    if sel.chosen is None and any(v.kind != "no_commit" for v in sel.rejected):
        return Choice(
            sel,
            exit_code=ExitCode.NO_CHECKPOINT,
            refusal="no checkpoint verifies (reasons above) and some were complete once: refusing to start over "
            "and overwrite them; move them away or use a new train.output_dir",
        )
    if sel.chosen is not None and max_steps is not None and (sel.step or 0) > max_steps:
        return Choice(
            sel,
            exit_code=ExitCode.USAGE,
            refusal=f"{sel.chosen.name} is past train.max_steps={max_steps}: the run already went further; "
            f"raise train.max_steps above {sel.step}, or use a new train.output_dir",
        )
    record = sel.verdict.record if sel.verdict is not None else None
    done = finished(rd, limits, sel.step) if limits is not None else None
    return Choice(sel, str(sel.chosen) if sel.chosen else None, sel.step, record, finished=done)
