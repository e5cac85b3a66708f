"""ftkit init: write a commented recipe and a hostfile example to start from."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import Problem, UserError
from ..render import write_files
from ..scaffold import HOSTFILE_TEMPLATE, RECIPE_TEMPLATES, read_template

TEMPLATE_HELP = "; ".join(f"{name}: {desc}" for name, (_, desc) in RECIPE_TEMPLATES.items())


@click.command(
    "init",
    epilog="""\b
Examples:
  ftkit init myjob                      # LoRA template
  ftkit init myjob --template full      # full fine-tuning
  ftkit init . --template cpu-demo --force
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
@click.option("--force", is_flag=True, help="Overwrite an existing recipe.yaml / hostfile.")
def command(directory: str, template: str, force: bool) -> None:
    """Write DIRECTORY/recipe.yaml (every key with its one-line doc above it) and DIRECTORY/hostfile."""
    out = Path(directory)
    targets = {
        "recipe.yaml": read_template(RECIPE_TEMPLATES[template][0]),
        "hostfile": read_template(HOSTFILE_TEMPLATE),
    }
    if out.exists() and not out.is_dir():
        raise UserError(Problem("exists and is not a directory; name a directory to write into", file=str(out)))
    existing = [out / name for name in targets if (out / name).exists()]
    if existing and not force:
        raise UserError([Problem("already exists; pass --force to overwrite", file=str(p)) for p in existing])
    for path in write_files(out, targets):  # all or nothing; an OS error names the path (exit 2, 12 for no space)
        click.echo(f"wrote {path}")
    click.echo(f"next: edit {out / 'recipe.yaml'} (model.path, data.train), then `ftkit plan {out / 'recipe.yaml'}`")
