"""ftkit explain: every rendered knob, its value, and the rule or source it came from."""

from __future__ import annotations

import json

import click

from ftkit.cli.options import json_option, overrides_argument, recipe_argument
from ftkit.plan.load import load_and_plan
from ftkit.recipe.load import DEFAULT


@click.command(
    "explain",
    epilog="""\b
Examples:
  ftkit explain recipe.yaml
  ftkit explain recipe.yaml zero.stage=3 --json
""",
)
@recipe_argument
@overrides_argument
@json_option
def command(recipe: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Show each derived knob (value and why) and each recipe key that was set (value and where)."""
    plan = load_and_plan(recipe, overrides)  # the plan decides every knob the configs carry (ftkit.plan.knobs)
    knobs = {k: {"value": v.value, "why": v.why} for k, v in plan.knobs.items()}
    keys = {k: {"value": plan.recipe.values[k], "source": s} for k, s in plan.recipe.sources.items() if s != DEFAULT}
    if as_json:
        click.echo(json.dumps({"knobs": knobs, "recipe": keys}, indent=2, default=str))
        return
    width = max(len(k) for k in knobs) + 2
    click.echo("Rendered knobs:")
    for k, v in knobs.items():
        click.echo(f"  {k:<{width}}{_fmt(v['value']):<14} {v['why']}")
    click.echo("\nRecipe keys set (everything else is a default):")
    width = max((len(k) for k in keys), default=0) + 2
    for k, v in keys.items():
        click.echo(f"  {k:<{width}}{_fmt(v['value']):<14} {v['source']}")


def _fmt(value: object) -> str:
    return json.dumps(value) if isinstance(value, (bool, list)) or value is None else str(value)
