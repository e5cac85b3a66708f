"""ftkit check: compare checked-in configs with a fresh render; exit 1 with a diff when they drifted."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import click

from ftkit.cli.options import out_option, overrides_argument, recipe_argument
from ftkit.errors import ExitCode, os_error
from ftkit.imports.against import check_against
from ftkit.plan.load import default_out_dir, load_and_plan
from ftkit.render import render_files, unused_files


@click.command(
    "check",
    epilog="""\b
Examples:
  ftkit check recipe.yaml            # in CI: exit 0 in sync, 1 drifted (diff printed), 2 bad recipe or path
  ftkit check recipe.yaml -o deploy
  ftkit check recipe.yaml --against train/ds_config.json   # a hand-written config, compared by meaning
""",
)
@recipe_argument
@out_option
@click.option(
    "--against",
    "against",
    multiple=True,
    type=click.Path(path_type=str),
    metavar="FILE",
    help='Compare a hand-written ds_config.json or accelerate.yaml by meaning (values, keys one side has, "auto" '
    "vs a value) with what RECIPE renders, instead of the files in OUT.",
)
@overrides_argument
def command(recipe: str, out: str | None, against: tuple[str, ...], overrides: tuple[str, ...]) -> None:
    """Re-render RECIPE in memory and compare with the files in OUT; print a unified diff per drifted file."""
    plan = load_and_plan(recipe, overrides)
    if against:
        lines, differences = check_against(plan, against)
        for line in lines:
            click.echo(line)
        if differences:
            click.echo(f"{differences} difference(s) from what {recipe} renders", err=True)
            sys.exit(ExitCode.DRIFT)
        return
    out_dir = Path(out) if out else default_out_dir(plan.recipe)
    drifted = 0
    for name, fresh in render_files(plan, out_dir).items():
        path = out_dir / name
        try:
            on_disk = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            click.echo(f"{path}: missing (run `ftkit render {recipe}`)")
            drifted += 1
            continue
        except (OSError, UnicodeDecodeError) as e:  # a directory, a path under a file, unreadable: not drift
            if isinstance(e, UnicodeDecodeError):
                e = OSError(0, f"not UTF-8 text ({e.reason} at byte {e.start})", str(path))
            raise os_error(e, path, "cannot read") from None
        if on_disk != fresh:
            drifted += 1
            diff = difflib.unified_diff(
                on_disk.splitlines(keepends=True),
                fresh.splitlines(keepends=True),
                fromfile=f"{path} (on disk)",
                tofile=f"{path} (rendered from {recipe})",
            )
            click.echo("".join(diff), nl=False)
        else:
            click.echo(f"{path}: in sync")
    for name in unused_files(plan, out_dir):
        click.echo(f"{out_dir / name}: not used with train.backend {plan.recipe.train.backend} (remove it)")
        drifted += 1
    if drifted:
        click.echo(f"{drifted} file(s) drifted; run `ftkit render {recipe}` to update them", err=True)
        sys.exit(ExitCode.DRIFT)
