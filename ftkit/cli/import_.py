"""ftkit import: existing DeepSpeed/Accelerate/TrainingArguments/Axolotl/LLaMA-Factory configs in, one recipe out."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ftkit.cli.options import hostfile_option
from ftkit.errors import Problem, UserError
from ftkit.imports import import_configs
from ftkit.render import write_files


@click.command(
    "import",
    short_help="Turn existing DeepSpeed, Accelerate, HF Trainer, Axolotl or LLaMA-Factory configs into a recipe.",
    epilog="""\b
Examples:
  ftkit import ds_config.json -o recipe.yaml --model ./models/llama
  ftkit import accelerate.yaml train.sh -o recipe.yaml       # + the ds_config both name
  ftkit import axolotl.yml -o recipe.yaml --accept datasets,sample_packing
  ftkit import deepspeed:ds.txt trainer:args.yaml           # KIND:PATH when the content does not tell
  ftkit import accelerate_fsdp.yaml --model ./model --plan  # + what ftkit's planner would choose instead
""",
)
@click.argument("sources", nargs=-1, required=True, metavar="SOURCE...")
@click.option("-o", "--out", "out", type=click.Path(path_type=str), default=None, help="Write the recipe here "
              "(default: print it; the report then goes to stderr).")  # fmt: skip
@click.option("--model", default=None, metavar="DIR|ORG/NAME", help="The model (model.path); its config.json gives "
              "the hidden size HF's \"auto\" bucket sizes use.")  # fmt: skip
@hostfile_option
@click.option("--accept", "accept", multiple=True, metavar="KEY,...", help="Import although these keys change "
              "training and cannot be carried (as the report spells them).")  # fmt: skip
@click.option("--plan", "plan", is_flag=True, help="Also print what ftkit's planner would choose for the imported "
              "job (ZeRO stage or FSDP2, offload, micro batch) against what the sources chose.")  # fmt: skip
@click.option("--force", is_flag=True, help="Overwrite an existing -o file.")
def command(
    sources: tuple[str, ...],
    out: str | None,
    model: str | None,
    hostfile: str | None,
    accept: tuple[str, ...],
    plan: bool,
    force: bool,
) -> None:
    """Read SOURCE... (deepspeed, accelerate, trainer, axolotl, llamafactory configs) and write one commented
    recipe. Every source key is reported once: mapped, equal to ftkit's default, "auto" resolved, or not carried
    (why). A key that changes training and cannot be carried stops the import (exit 2) unless named in --accept."""

    target = Path(out) if out else None
    if target is not None and target.exists() and not force:
        raise UserError(Problem("already exists; pass --force to overwrite", file=str(target)))
    if target is not None and target.is_dir():
        raise UserError(Problem("is a directory; name the recipe file to write", file=str(target)))
    result = import_configs(sources, model=model, hostfile=hostfile, accept=accept, out=target, plan=plan)
    report = sys.stdout if target is not None else sys.stderr
    for line in [*result.lines, *result.plan]:
        click.echo(line, file=report)
    if target is None:
        click.echo(result.recipe_text, nl=False)
        return
    for path in write_files(target.parent, {target.name: result.recipe_text}):  # all or nothing
        click.echo(f"wrote {path}")
    todo = f" (fill in {', '.join(result.placeholders)})" if result.placeholders else ""
    click.echo(f"next: review {target}{todo}, then `ftkit render {target}` and `ftkit check {target} --against FILE`")
