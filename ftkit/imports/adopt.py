"""``ftkit import ... --plan``: what ftkit's planner would choose for the imported job against what its sources
chose (sharding stage and offload, micro batch), with the memory per GPU and the predicted step time of each, so
a team sees what adopting ftkit changes before it changes anything.

The planner gets the imported recipe with the choices opened (``zero.stage: auto``, ``zero.offload_optimizer: auto``,
parameter offload left out; for an FSDP source ``train.backend: auto`` and the ``fsdp`` choices left out as well, so
ZeRO's and FSDP2's candidates compete); when
nothing fits at the source's micro batch it halves the micro batch (the global batch stays) until something does,
as ``ftkit init --model`` sizes a template.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml

from ftkit.errors import FtkitError
from ftkit.plan.candidates import plan_candidate, plan_memory, predict_plan
from ftkit.plan.plan import Plan, build_plan
from ftkit.recipe.load import load_recipe
from ftkit.recipe.schema import FIELD_BY_KEY


def plan_lines(recipe_text: str, base: Path) -> list[str]:
    """The comparison, one line per row; ``recipe_text``'s relative paths are relative to ``base``."""
    overrides = _absolute_paths(recipe_text, base)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "recipe.yaml"
        path.write_text(recipe_text, encoding="utf-8")
        try:
            source = build_plan(load_recipe(path, overrides), strict=False)
        except FtkitError as e:
            why = e.lines()[0].replace(str(path), "the imported recipe")
            return [f"plan: not computed: {why} (--model gives the model whose config.json the planner reads)"]
        fsdp2 = source.recipe.train.backend == "fsdp2"
        opened = ["zero.stage=auto", "zero.offload_optimizer=auto"] + (["train.backend=auto"] if fsdp2 else [])
        free = Path(d) / "opened.yaml"
        free.write_text(_opened(recipe_text), encoding="utf-8")
        chosen, why = _ftkit_choice(free, overrides + opened, source.micro_batch_size)
    opened_text = ", ".join(o.replace("=", ": ") for o in opened)
    rows = [("", "the sources", f"ftkit plan ({opened_text})")]
    for name, show in (("sharding", _sharding), ("micro batch", _batch), ("memory per GPU", _memory)):
        rows.append((name, show(source), show(chosen) if chosen else why if name == "sharding" else ""))
    rows.append(("predicted step", _step(source), _step(chosen) if chosen else ""))
    width = max(len(r[1]) for r in rows) + 2
    lines = ["plan: what ftkit's planner chooses for this job against what the sources chose"]
    lines += [f"  {name:<16}{a:<{width}}{b}".rstrip() for name, a, b in rows]
    if chosen is not None:
        lines.append("  " + _adopt(source, chosen))
    return lines


# keys the planner decides when the recipe leaves them out (a key the recipe states narrows its candidates)
OPENED = ("zero.offload_params", "fsdp.reshard_after_forward", "fsdp.offload_params")


def _opened(text: str) -> str:
    """The recipe without the choices the planner makes itself when they are left out."""
    values = yaml.safe_load(text) or {}
    for key in OPENED:
        section, _, name = key.partition(".")
        body = values.get(section)
        if isinstance(body, dict):
            body.pop(name, None)
    return yaml.safe_dump(values, sort_keys=False)


def _absolute_paths(text: str, base: Path) -> list[str]:
    """``key=/absolute/path`` overrides for the recipe's relative local paths (it is planned from a temporary
    directory); hub ids and absolute paths stay as they are."""
    values = yaml.safe_load(text) or {}
    out = []
    for section, body in values.items():
        if not isinstance(body, dict):
            continue
        for name, value in body.items():
            f = FIELD_BY_KEY.get(f"{section}.{name}")
            if f is None or "path" not in f.type.split("|") or not isinstance(value, str) or value == "auto":
                continue
            if value.startswith(("./", "../")) or (base / value).exists():
                out.append(f"{section}.{name}={(base / value).resolve()}")
    return out


def _ftkit_choice(path: Path, overrides: list[str], micro: int) -> tuple[Plan | None, str]:
    """The planner's plan, halving the micro batch until a candidate fits; (None, why) when none does."""
    why = ""
    while micro >= 1:
        try:
            return build_plan(load_recipe(path, [*overrides, f"train.micro_batch_size={micro}"])), ""
        except FtkitError as e:
            why = e.lines()[0].replace(str(path), "the imported recipe").split(": ", 1)[-1]
            micro //= 2
    return None, f"nothing fits: {why}"


def _sharding(p: Plan) -> str:
    return plan_candidate(p).label


def _batch(p: Plan) -> str:
    return f"{p.micro_batch_size} (x {p.grad_accum} accumulation x {p.world_size} ranks)"


def _memory(p: Plan) -> str:
    report = p.memory or plan_memory(p)
    label = plan_candidate(p).label
    estimate = next((e for e in report.choice.estimates if e.candidate.label == label), report.selected)
    if estimate is None:
        return "not estimated"
    verdict = "fits" if estimate.fits else "does not fit"
    return f"{estimate.total_gb:.1f} of {report.gpu_memory_gb:g} GiB, {verdict}"


def _step(p: Plan) -> str:
    return f"{predict_plan(p).step_time_s:.3g} s"


def _adopt(source: Plan, chosen: Plan) -> str:
    same = _sharding(source) == _sharding(chosen) and source.micro_batch_size == chosen.micro_batch_size
    if same:
        return "ftkit would run the job as the sources chose it"
    r = chosen.recipe
    if r.train.backend == "fsdp2":
        keys = [
            "train.backend=fsdp2",
            f"fsdp.reshard_after_forward={str(r.fsdp.reshard_after_forward).lower()}",
            f"fsdp.offload_params={str(r.fsdp.offload_params).lower()}",
        ]
    else:
        keys = [
            *(["train.backend=deepspeed"] if source.recipe.train.backend != "deepspeed" else []),
            f"zero.stage={chosen.stage}",
            f"zero.offload_optimizer={chosen.offload_optimizer}",
            f"zero.offload_params={chosen.offload_params}",
        ]
    if source.micro_batch_size != chosen.micro_batch_size:
        keys.append(f"train.micro_batch_size={chosen.micro_batch_size}")
    return "to adopt ftkit's choice, set " + " ".join(keys) + " in the recipe (or keep the sources' choice)"
