"""Options shared by several commands, declared once so their help text is identical everywhere.

Path arguments leave file/directory checks to the code that opens them, so a wrong kind of path gets ftkit's one
line naming it (``ftkit: error: PATH: ...``, exit 2) like every other problem, not click's usage block.
"""

from __future__ import annotations

import click

recipe_argument = click.argument("recipe", type=click.Path(path_type=str), metavar="RECIPE")
overrides_argument = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
out_option = click.option(
    "-o",
    "--out",
    "out",
    type=click.Path(path_type=str),
    default=None,
    help="Directory for ds_config.json and accelerate.yaml (default: configs/ beside the recipe).",
)
ssh_config_option = click.option(
    "--ssh-config",
    type=click.Path(path_type=str),
    default=None,
    help="ssh configuration file for reaching the run's other hosts (default: your own ~/.ssh/config). The "
    "cluster.ssh_config recorded in the run directory is never used: anyone who can write there could run commands "
    "(ProxyCommand) as you.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
hostfile_option = click.option(
    "--hostfile",
    type=click.Path(path_type=str),
    default=None,
    help="Hostfile (host slots=N per line); same as cluster.hostfile=FILE.",
)
include_option = click.option("--include", default=None, help="DeepSpeed-style host filter, e.g. 'node1@node2:0,1'.")
exclude_option = click.option(
    "--exclude", default=None, help="DeepSpeed-style host filter of hosts/slots to leave out."
)
engine_option = click.option(
    "--engine",
    type=click.Choice(["deepspeed", "accelerate", "torchrun", "slurm", "auto"]),
    default=None,
    help="Launcher to use; same as cluster.engine=NAME.",
)


def cli_overrides(overrides: tuple[str, ...], hostfile: str | None = None, engine: str | None = None) -> list[str]:
    """Options that are shorthands for recipe keys become overrides, so precedence stays CLI > file > default."""
    out = list(overrides)
    if hostfile is not None:
        out.append(f"cluster.hostfile={hostfile}")
    if engine is not None:
        out.append(f"cluster.engine={engine}")
    return out


class AfterDashes(click.Command):
    """A command whose words after the first ``--`` are kept apart, untouched, before click parses ftkit's own
    arguments (they may look like options or ``key=value``): ``rest(ctx)`` returns them (None: no ``--``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            i = args.index("--")
            ctx.meta["ftkit.after_dashes"] = tuple(args[i + 1 :])
            args = args[:i]
        return super().parse_args(ctx, args)


def after_dashes(ctx: click.Context) -> tuple[str, ...] | None:
    """The words after ``--`` on the command line of an :class:`AfterDashes` command (None: there was no ``--``)."""
    return ctx.meta.get("ftkit.after_dashes")
