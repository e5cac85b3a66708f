"""Choose where an attempt resumes from (read-only): the first step of the supervisor's script (:mod:`ftkit.supervise`).

Checkpoints are walked newest first and the first whose commit record verifies (every byte, by default) is taken.
A checkpoint of another world size or stage is refused, unless the supervisor itself shrank the job (then it is
converted to DeepSpeed's universal format); a run whose checkpoints were all complete once but none verifies now
refuses to start over; a checkpoint past ``train.max_steps`` refuses too. Nothing is written here:
:meth:`ftkit.supervise.Supervisor.apply` carries the choice out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checkpoints import Selection, select_resume
from .errors import ExitCode
from .rundir import RunDir


@dataclass
class Choice:
    """The outcome of :func:`select`: where to resume from (None: fresh), or why the run cannot go on."""

    selection: Selection | None
    resume: str | None = None
    step: int | None = None
    record: dict[str, Any] | None = None
    exit_code: int | None = None
    refusal: str | None = None  # one line: why exit_code
    convert: bool = False  # resume needs a universal conversion of an incompatible checkpoint (after a shrink)


def select(
    rd: RunDir,
    *,
    checksums: bool,
    world_size: int,
    stage: int,
    max_steps: int | None,
    convert_from_world: int | None = None,
) -> Choice:
    """The checkpoint to resume from, or why the run cannot continue. ``convert_from_world``: after a shrink,
    checkpoints of that world size are converted rather than refused."""
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
    return Choice(sel, str(sel.chosen) if sel.chosen else None, sel.step, record)
