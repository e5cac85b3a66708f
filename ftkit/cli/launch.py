"""ftkit launch: parse the command line and call :func:`ftkit.run.job.launch`."""

from __future__ import annotations

import sys

import click

from ftkit.cli.options import (
    AfterDashes,
    after_dashes,
    cli_overrides,
    engine_option,
    exclude_option,
    hostfile_option,
    include_option,
    overrides_argument,
    recipe_argument,
)
from ftkit.run.job import LaunchRequest, launch


@click.command(
    "launch",
    cls=AfterDashes,
    epilog="""\b
Examples:
  ftkit launch recipe.yaml                               # this machine
  ftkit launch recipe.yaml --hostfile hostfile           # several hosts (ssh/pdsh)
  ftkit launch recipe.yaml --engine torchrun --dry-run   # print per-node argv and env, start nothing
  ftkit launch recipe.yaml train.max_steps=2000          # continue a finished run for more steps
  ftkit launch recipe.yaml train.learning_rate=1e-4 --allow-changes train.learning_rate
  ftkit launch recipe.yaml -- python sft.py --output_dir out   # your own HF Trainer script on every rank
  ftkit launch recipe.yaml -- python -m trl.scripts.sft --model_name_or_path ./model --dataset_name ./data
\b
After `--`: your command (python SCRIPT ARGS, python -m MODULE ARGS, or a program such as `trl sft ARGS`, which
is run as python -m trl.scripts.sft ARGS), instead of the built-in entry; the recipe may hold it as
train.command (the command line wins). ftkit's import hook applies the recipe's TrainingArguments to it and lists
each change; --no-inject leaves the script alone (it then uses ftkit.hf itself).
\b
Exit codes: 0 success, 2 bad recipe/hostfile/data/command or a refused change, 3 preflight failed, 4 restart
budget exhausted, 5 no valid checkpoint, 6 training failed otherwise, 7 host lost (cluster.min_nodes), 8 stopped
on request, 9 resumed state disagrees with the logged run, 11 a live job owns the run directory, 12 no space
left, 14 the training script failed before its first step, 129/130/143 interrupted.
""",
)
@recipe_argument
@overrides_argument
@hostfile_option
@include_option
@exclude_option
@engine_option
@click.option(
    "--dry-run", is_flag=True, help="Print the plan and the exact per-node argv and environment; start nothing."
)
@click.option(
    "--takeover",
    is_flag=True,
    help="The run's previous supervisor died and its ranks still run: stop them on every host, then continue.",
)
@click.option(
    "--allow-changes",
    "allow_changes",
    multiple=True,
    metavar="KEY[,KEY...]",
    help="Apply these changed recipe keys to a resumed run (e.g. train.learning_rate); others are refused.",
)
@click.option(
    "--no-inject",
    "no_inject",
    is_flag=True,
    help="Run the command after -- without ftkit's import hook (the script calls ftkit.hf itself).",
)
@click.pass_context
def command(
    ctx: click.Context,
    recipe: str,
    overrides: tuple[str, ...],
    hostfile: str | None,
    include: str | None,
    exclude: str | None,
    engine: str | None,
    dry_run: bool,
    takeover: bool,
    allow_changes: tuple[str, ...],
    no_inject: bool,
) -> None:
    """Launch RECIPE: validate, plan, own the run directory, preflight, render into it, start, supervise, recover.

    With `-- CMD [ARGS]`, every rank runs CMD instead of ftkit's built-in training entry."""

    request = LaunchRequest(
        recipe=recipe,
        overrides=tuple(cli_overrides(overrides, hostfile, engine)),
        include=include,
        exclude=exclude,
        dry_run=dry_run,
        takeover=takeover,
        allow_changes=allow_changes,
        command=after_dashes(ctx),
        inject=not no_inject,
    )
    sys.exit(launch(request, echo=click.echo, warn=lambda line: click.echo(line, err=True)))
