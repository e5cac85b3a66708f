"""ftkit init: write a commented recipe and a hostfile example to start from."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ftkit.errors import Problem, UserError
from ftkit.plan.load import sized_for_model
from ftkit.recipe.scaffold import HOSTFILE_TEMPLATE, RECIPE_TEMPLATES, read_template, with_model
from ftkit.render import write_files

TEMPLATE_HELP = "; ".join(f"{name}: {desc}" for name, (_, desc) in RECIPE_TEMPLATES.items())


@click.command(
    "init",
    epilog="""\b
Examples:
  ftkit init myjob                      # LoRA template
  ftkit init myjob --template full      # full fine-tuning
  ftkit init . --template cpu-demo --force
  ftkit init myjob --model Qwen/Qwen2.5-7B-Instruct --revision main   # model.path: a hub id
""",
)
@click.argument("directory", default=".", type=click.Path(path_type=str))
@click.option(
    "--template",
    "-t",
    "template",
    type=click.Choice(list(RECIPE_TEMPLATES)),
    default="lora",
    show_default=True,
    help=TEMPLATE_HELP,
)
@click.option(
    "--model",
    "model",
    default=None,
    metavar="ORG/NAME|DIR",
    help="Fill model.path: a hub id (org/name) or a local model directory.",
)
@click.option("--revision", default=None, help="Fill model.revision: a hub branch, tag or commit (with --model).")
@click.option("--force", is_flag=True, help="Overwrite an existing recipe.yaml / hostfile.")
def command(directory: str, template: str, model: str | None, revision: str | None, force: bool) -> None:
    """Write DIRECTORY/recipe.yaml (every key with its one-line doc above it) and DIRECTORY/hostfile."""
    out = Path(directory)
    recipe_text = read_template(RECIPE_TEMPLATES[template][0])
    if revision is not None and model is None:
        raise UserError(Problem("--revision needs --model ORG/NAME", key="--revision"))
    sized = ""
    if model is not None:
        local = Path(model).expanduser()
        if local.is_dir():  # a model directory: absolute to plan, relative to DIRECTORY in the written recipe
            planned = with_model(recipe_text, str(local.resolve()), revision)
            model = os.path.relpath(local.resolve(), out.resolve())
        else:
            planned = with_model(recipe_text, model, revision)
        sized_text, sized = sized_for_model(planned)
        recipe_text = with_model(sized_text, model, revision)
    targets = {
        "recipe.yaml": recipe_text,
        "hostfile": read_template(HOSTFILE_TEMPLATE),
    }
    if out.exists() and not out.is_dir():
        raise UserError(Problem("exists and is not a directory; name a directory to write into", file=str(out)))
    existing = [out / name for name in targets if (out / name).exists()]
    if existing and not force:
        raise UserError([Problem("already exists; pass --force to overwrite", file=str(p)) for p in existing])
    for path in write_files(out, targets):  # all or nothing; an OS error names the path (exit 2, 12 for no space)
        click.echo(f"wrote {path}")
    if sized:
        click.echo(f"{out / 'recipe.yaml'}: {sized}")
    todo = "data.train" if model is not None else "model.path, data.train"
    click.echo(f"next: edit {out / 'recipe.yaml'} ({todo}), then `ftkit plan {out / 'recipe.yaml'}`")
