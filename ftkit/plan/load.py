"""The steps every config-producing command shares: load the recipe, plan, render (no writing here)."""

from __future__ import annotations

from pathlib import Path

import yaml

from ftkit.errors import FtkitError
from ftkit.plan.memory import zero_label
from ftkit.plan.plan import Plan, build_plan
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
