"""The ``ftkit`` command group and its single exit point for errors.

Library code raises :class:`ftkit.errors.FtkitError`; here, and only here, it becomes a message on stderr (one
line per problem, no traceback) and the documented exit code.
"""

from __future__ import annotations

import sys

import click

from .. import __version__
from ..errors import FtkitError

EPILOG = """\b
Examples:
  ftkit init myjob --template lora      # write myjob/recipe.yaml and myjob/hostfile
  ftkit plan myjob/recipe.yaml          # which ZeRO stage fits, and why
  ftkit render myjob/recipe.yaml        # write myjob/configs/{ds_config.json,accelerate.yaml}
  ftkit check myjob/recipe.yaml         # fail (exit 1) when checked-in configs drifted
  ftkit launch myjob/recipe.yaml        # run it, restarting from the newest committed checkpoint
"""


class FtkitGroup(click.Group):
    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except FtkitError as e:
            for line in e.lines():
                click.echo(f"ftkit: error: {line}", err=True)
            sys.exit(e.exit_code)


@click.group(cls=FtkitGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ftkit")
def cli() -> None:
    """ftkit: one fine-tuning recipe in; DeepSpeed and Accelerate configs, a memory plan, a launched and
    supervised HF Trainer job out."""


def _register() -> None:
    from . import check, explain, init, launch, plan, render, schema, status

    for mod in (init, render, check, explain, plan, launch, status, schema):
        cli.add_command(mod.command)


_register()


def main() -> None:
    cli(prog_name="ftkit")
