"""The steps every config-producing command shares: load the recipe, plan, render (no writing here)."""

from __future__ import annotations

from pathlib import Path

from ftkit.plan.plan import Plan, build_plan
from ftkit.recipe.load import Recipe, load_recipe


def default_out_dir(recipe: Recipe) -> Path:
    return recipe.base_dir / "configs"


def load_and_plan(recipe_path: str, overrides: tuple[str, ...] | list[str], **kw: object) -> Plan:
    return build_plan(load_recipe(recipe_path, list(overrides)), **kw)  # type: ignore[arg-type]
