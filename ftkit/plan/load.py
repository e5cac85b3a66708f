"""The steps every config-producing command shares: load the recipe, plan, render (no writing here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ftkit.errors import FtkitError, Problem, UserError
from ftkit.plan.calibrate import measured_step, run_recipe, store
from ftkit.plan.candidates import full_table
from ftkit.plan.inputs import gather
from ftkit.plan.memory import zero_label
from ftkit.plan.plan import Plan, build_plan, calibration_points, merged, plan_from
from ftkit.plan.speed import Calibration, CalPoint
from ftkit.plan.types import MemoryReport
from ftkit.recipe.load import Recipe, load_recipe
from ftkit.recipe.scaffold import commented_recipe, split_header
from ftkit.recipe.schema import SECTIONS


def default_out_dir(recipe: Recipe) -> Path:
    return recipe.base_dir / "configs"


def load_and_plan(
    recipe_path: str,
    overrides: tuple[str, ...] | list[str],
    *,
    include: str | None = None,
    exclude: str | None = None,
    strict: bool = True,
    with_memory: bool = True,
) -> Plan:
    recipe = load_recipe(recipe_path, list(overrides))
    return build_plan(recipe, include=include, exclude=exclude, strict=strict, with_memory=with_memory)


@dataclass
class PlanReport:
    """What ``ftkit plan`` prints: the plan, every candidate judged, and the calibration it used."""

    plan: Plan
    table: MemoryReport
    calibration: Calibration | None
    measured: list[CalPoint] = field(default_factory=list)  # the runs --calibrate (or --probe) measured
    stored: str = ""  # where the calibration was kept (beside the recipe's run directory)


def plan_report(
    recipe_path: str, overrides: tuple[str, ...] | list[str], *, calibrate: tuple[str, ...] | list[str] = ()
) -> PlanReport:
    """``ftkit plan``: the plan with every candidate's memory and step time. ``calibrate``: run directories whose
    measured step times calibrate the step-time model (:mod:`ftkit.plan.calibrate`); the calibration is then kept
    beside the recipe's run directory, so later plans of the recipe use it. Whatever it is given, a plan also uses
    the calibration already kept there and the run directory's own earlier attempts."""
    recipe = load_recipe(recipe_path, list(overrides))
    inputs = gather(recipe)
    runs = [str(Path(d)) for d in calibrate]
    for d in runs:
        if run_recipe(d) is None:
            raise UserError(Problem("not an ftkit run directory (no ftkit/spec.json)", file=d))
        if measured_step(d) is None:
            raise UserError(Problem("too few logged steps to measure a step time (metrics.jsonl)", file=d))
    skipped: dict[str, str] = {}
    measured = calibration_points(runs, inputs.gpu, skipped) if runs and inputs.shape is not None else []
    if skipped:
        raise UserError([Problem(why, file=d) for d, why in skipped.items()])
    own = calibration_points([recipe.train.output_dir], inputs.gpu) if inputs.shape is not None else []
    cal = inputs.calibration
    if own or measured:
        cal = merged(cal, [*measured, *own], inputs.gpu)
    stored = ""
    if measured and cal is not None:
        stored = str(store(recipe.train.output_dir, cal))
    plan = plan_from(dataclasses.replace(inputs, calibration=cal), strict=False)
    return PlanReport(plan, full_table(plan), cal, measured, stored)


def sized_for_model(text: str) -> tuple[str, str]:
    """``text`` (a recipe naming its model) with ``zero.stage``/offload and ``train.micro_batch_size`` set to what
    ``ftkit plan`` picks for that model on the template's cluster (``auto``, halving the micro batch until something
    fits), and a one-line note saying what was chosen, or why nothing was (config.json not resolvable, nothing fits).
    Model paths in ``text`` must be absolute or hub ids: it is planned from a temporary file."""
    import tempfile
    from pathlib import Path

    values = yaml.safe_load(text) or {}
    micro = int((values.get("train") or {}).get("micro_batch_size") or 1)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "recipe.yaml"
        path.write_text(text, encoding="utf-8")
        while micro >= 1:
            overrides = ["zero.stage=auto", "zero.offload_optimizer=auto", f"train.micro_batch_size={micro}"]
            try:
                p = build_plan(load_recipe(path, overrides))
            except FtkitError as e:
                note = e.lines()[0]
                note = note.split(" ", 1)[-1] if note.startswith(str(path)) else note  # not the temporary file
                if " model." in f" {note}" or micro == 1:
                    return text, f"not sized for the model ({note})"
                micro //= 2
                continue
            break
    if p.offload_optimizer == "nvme" or p.offload_params == "nvme":
        return text, "not sized for the model: it needs nvme offload (set zero.nvme_path, then `ftkit plan`)"
    train, zero = dict(values.get("train") or {}), dict(values.get("zero") or {})
    train["micro_batch_size"] = micro
    zero.update(stage=p.stage, offload_optimizer=p.offload_optimizer, offload_params=p.offload_params)
    values["train"], values["zero"] = train, zero
    for sec in SECTIONS:
        if sec.optional and sec.name not in values:
            values[sec.name] = None
    why = zero_label(p.stage, p.offload_optimizer, p.offload_params)
    why += f", micro_batch_size {micro} (per ftkit plan for this model)"
    return commented_recipe(values, split_header(text)), why
