"""Resume selection: where the next attempt resumes from, as one decision (:class:`Resume`).

:meth:`Resumer.next` walks the first step of the supervisor's script for an attempt:

* **choose** (:func:`ftkit.supervise.choose.select`, read-only): the newest checkpoint whose commit record verifies,
  every byte checked;
* **tiers** (:class:`ftkit.supervise.tier_resume.LocalTier`): a newer step verified on every node's local tier wins; one
  the survivors assemble in the run directory from peer copies is chosen again, as a durable checkpoint;
* **carry it out** (:meth:`Resumer.apply`): log the rejected checkpoints, set newer torn ones aside (so the resumed
  run can write that step again) and, after a shrink, convert the newest checkpoint of the old world size to
  DeepSpeed's universal format (:mod:`ftkit.supervise.shrink`); then the local tier's later steps are removed.

:meth:`Resumer.shrink` replans the job on the hosts that are left (through the launch's :class:`Replanner`); from
then on checkpoints of the old world size are converted rather than refused, and the attempt that loads a universal
checkpoint is the only one that does (:meth:`Resumer.restarting`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ftkit.checkpoint.directory import list_checkpoints, select_resume, set_aside_newer
from ftkit.checkpoint.verify import verify
from ftkit.errors import ExitCode, UserError
from ftkit.supervise.choose import Choice, StepLimits, select
from ftkit.supervise.shrink import convert_newest

if TYPE_CHECKING:
    from ftkit.plan.plan import Plan
    from ftkit.rundir.layout import RunDir
    from ftkit.rundir.records import EventSink
    from ftkit.supervise.tier_resume import LocalTier, TierChoice


class Replanner(Protocol):
    """Continuing on fewer hosts (the launch gives it: :class:`ftkit.run.job.Replan`)."""

    def replan(self, hosts: list[tuple[str, int]]) -> Plan:
        """The job planned on ``hosts``; raises UserError when the global batch cannot be kept."""
        ...

    def prepare(self, plan: Plan, load_universal: bool) -> object:
        """Write the run's configs and spec for ``plan`` (loading a universal checkpoint, or not)."""
        ...


@dataclass(frozen=True)
class Resume:
    """Where an attempt resumes from (``choice.resume``, None: fresh) and from which tier: ``local``, ``peer`` (a
    step assembled from peer copies this time) or ``durable``; or, ``exit_code`` set, why the run cannot go on."""

    choice: Choice
    tier: str = "durable"

    @property
    def exit_code(self) -> int | None:
        return self.choice.exit_code


class Resumer:
    """Resume selection over the launch: ``world_size`` is the job's now (a shrink changes it)."""

    def __init__(
        self,
        rd: RunDir,
        events: EventSink,
        tier: LocalTier,
        *,
        checksums: bool,
        world_size: int,
        stage: int,
        max_steps: int | None,
        replanner: Replanner | None = None,
    ):
        self.rd, self.events, self.tier = rd, events, tier
        self.checksums = checksums
        self.world_size, self.stage, self.max_steps = world_size, stage, max_steps
        self.replanner = replanner
        self._convert_from_world: int | None = None  # set after a shrink: checkpoints of that size get converted
        self._plan: Plan | None = None  # the plan of the shrunk job
        self._universal = False  # the configs written load a universal checkpoint

    def select(self, limits: StepLimits | None = None) -> Choice:
        """Read-only: the checkpoint to resume from, or why the run cannot continue. Writes nothing. ``limits``
        (the recipe's step limits, at launch): a run already finished for them says so."""
        return select(
            self.rd,
            checksums=self.checksums,
            world_size=self.world_size,
            stage=self.stage,
            max_steps=self.max_steps,
            convert_from_world=self._convert_from_world,
            limits=limits,
        )

    def next(self, first: Choice | None, hosts: list[str]) -> Resume:
        """The resume of the attempt on ``hosts``. ``first``: a choice the launch already made (and checked)."""
        choice = first if first is not None else self.select()
        local: TierChoice | None = None
        peer_step: int | None = None
        # before the durable choice is carried out: a newer step verified in every node's local tier (kept apart),
        # or one the survivors assemble from peer copies (then chosen again: it is durable now, and converted after
        # a shrink like any other)
        picked = (
            self.tier.choose(hosts, self.world_size, choice.step, self.max_steps) if choice.exit_code is None else None
        )
        if picked is not None and picked.tier == "peer":
            peer_step = picked.step
            choice = self.select()
        elif picked is not None:
            local = picked
        choice = self.apply(choice, announce=local is None)
        if choice.exit_code is not None:
            return Resume(choice)
        if local is not None:
            choice = self._resume_local(choice, local)
        self.tier.discard_stale(hosts, choice.step)
        if local is not None:
            return Resume(choice, "local")
        return Resume(choice, "peer" if peer_step is not None and choice.step == peer_step else "durable")

    def apply(self, choice: Choice, announce: bool = True) -> Choice:
        """Carry a choice out: log the rejected checkpoints, set newer torn ones aside, convert after a shrink.
        ``announce=False``: the checkpoint resumed from is said by the caller (a local tier's step)."""
        sel = choice.selection
        for v in sel.rejected if sel else []:
            self.events(
                "checkpoint_rejected",
                f"skipping {v.reason}",  # the reason starts with the checkpoint's name
                checkpoint=str(v.path),
                reason=v.reason,
                kind=v.kind,
            )
        if choice.exit_code is not None:
            self.events("refused", choice.refusal)
            return choice
        assert sel is not None
        if choice.convert:
            converted = convert_newest(sel, sel.incompatible, self.world_size, self.events)
            if isinstance(converted, int):
                return Choice(sel, exit_code=converted, refusal="conversion refused")
            if converted is not None:
                if self.replanner is not None and self._plan is not None:
                    self.replanner.prepare(self._plan, True)
                    self._universal = True
                v = max(sel.incompatible, key=lambda x: x.step or -1)
                return Choice(sel, converted, v.step, v.record)
        for dst in set_aside_newer(self.rd.path, sel):
            self.events("set_aside", f"moved {dst.name.split('.rejected')[0]} aside to {dst.name}", dst=str(dst))
        if not announce:
            pass
        elif sel.chosen is None:
            self.events("fresh_start", None)
        else:
            last = self.max_steps is not None and sel.step == self.max_steps
            self.events(
                "checkpoint_chosen",
                f"resuming from {sel.chosen.name} (step {sel.step}, commit verified)"
                + (": it is train.max_steps, so the ranks write final/ from it without training" if last else ""),
                checkpoint=str(sel.chosen),
                step=sel.step,
            )
        return choice

    def _resume_local(self, choice: Choice, local: TierChoice) -> Choice:
        self._prepare_own()  # the durable choice was converted; a local part is this world size's
        self.events(
            "checkpoint_chosen",
            f"resuming from checkpoint-{local.step} in the local tier (commit verified on every node)",
            checkpoint=local.resume,
            step=local.step,
            tier="local",
        )
        return Choice(choice.selection, local.resume, local.step, None)

    def restarting(self) -> None:
        """Before the next attempt: later attempts load the new world size's own checkpoints."""
        self._prepare_own()

    def _prepare_own(self) -> None:
        if self._universal and self.replanner is not None and self._plan is not None:
            self.replanner.prepare(self._plan, False)
            self._universal = False

    def shrink(self, hosts: list[tuple[str, int]], lost: list[str]) -> Plan | int:
        """Replan on the hosts that are left (keeping the global batch): the new plan, or an exit code when that is
        impossible."""
        remaining = [(h, n) for h, n in hosts if h not in lost]
        if self.replanner is None:
            return ExitCode.HOST_LOST
        try:
            plan = self.replanner.replan(remaining)
        except UserError as e:
            self.events("gave_up", f"cannot continue on {', '.join(h for h, _ in remaining)}: {e.lines()[0]}")
            return ExitCode.HOST_LOST
        if plan.tp * plan.sp > 1:
            # DeepSpeed's universal conversion re-forms ZeRO's data-parallel shards, not AutoTP's split layers or an
            # SP group's data order: the job stops whole, and a relaunch on every host resumes it
            self.events(
                "gave_up",
                f"cannot continue on {', '.join(h for h, _ in remaining)}: a tensor/sequence-parallel run (tp "
                f"{plan.tp} x sp {plan.sp}) does not continue on fewer hosts (its checkpoints are not converted to "
                "another layout); bring the host(s) back and launch again: it resumes from the newest committed step",
            )
            return ExitCode.HOST_LOST
        self._plan = plan
        self.replanner.prepare(plan, False)
        self._convert_from_world = self.world_size
        self.world_size = plan.world_size
        self.events(
            "shrink",
            f"continuing on {', '.join(h for h, _ in plan.hosts)}: world size {plan.world_size}, global batch "
            f"{plan.global_batch_size} kept with gradient accumulation {plan.grad_accum}",
            hosts=[list(h) for h in plan.hosts],
            world_size=plan.world_size,
            global_batch_size=plan.global_batch_size,
            gradient_accumulation_steps=plan.grad_accum,
        )
        return plan

    def newest_commit(self) -> int | None:
        """The newest committed step, durable or in every node's local tier (the next attempt resumes from it when
        it verifies). Sizes only: this feeds the no-progress rule; the resume choice itself reads every byte."""
        sel = select_resume(
            self.rd.path, checksums=False, require_commit=True, world_size=self.world_size, stage=self.stage
        )
        steps = [s for s in [sel.step, *self.tier.steps()] if s is not None]
        return max(steps) if steps else None

    def discard_torn(self) -> None:
        """After a full disk: delete uncommitted checkpoints newer than the newest committed one. They can never be
        resumed from, and keeping them keeps the disk full; committed ones are untouched."""
        newest = self.newest_commit()
        for step, path in list_checkpoints(self.rd.path):
            if (newest is None or step > newest) and not verify(path, False, require_commit=True).committed:
                doomed = path.with_name(f".deleting-{path.name}")
                try:
                    path.rename(doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
                    self.events("discarded", f"deleted {path.name}: torn by the full disk, never committed")
                except OSError:
                    pass
