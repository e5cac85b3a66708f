"""ftkit render: write ds_config.json and accelerate.yaml from a recipe."""

from __future__ import annotations

from pathlib import Path

import click

from ftkit.cli.options import out_option, overrides_argument, recipe_argument
from ftkit.plan.load import default_out_dir, load_and_plan
from ftkit.render import render_files, write_files


@click.command(
    "render",
    epilog="""\b
Examples:
  ftkit render recipe.yaml                      # -> configs/ds_config.json, configs/accelerate.yaml
  ftkit render recipe.yaml -o deploy zero.stage=3 train.precision=fp16
""",
)
@recipe_argument
@out_option
@overrides_argument
def command(recipe: str, out: str | None, overrides: tuple[str, ...]) -> None:
    """Render RECIPE into DeepSpeed and Accelerate configs (deterministic, concrete values).

    KEY=VALUE overrides win over the recipe file, which wins over the defaults. Nothing is written unless the
    whole recipe is valid.
    """
    plan = load_and_plan(recipe, overrides)
    out_dir = Path(out) if out else default_out_dir(plan.recipe)
    files = render_files(plan, out_dir)
    for path in write_files(out_dir, files):
        click.echo(f"wrote {path}")
