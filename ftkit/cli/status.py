"""ftkit status: what happened in a run directory."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import Problem, UserError
from ..runstatus import format_summary, plot_losses, summarize
from .options import json_option


@click.command(
    "status",
    epilog="""\b
Examples:
  ftkit status runs/demo
  ftkit status runs/demo --plot loss.png     # loss against step, restarts marked
  ftkit status runs/demo --verify --json
""",
)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=str))
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Write a PNG of loss against step with each restart marked.",
)
@click.option("--verify", is_flag=True, help="Verify checkpoint checksums too (reads a sample of every file).")
@json_option
def command(run_dir: str, plot: str | None, verify: bool, as_json: bool) -> None:
    """Summarise RUN_DIR: attempts, restarts, current step, loss, checkpoints (committed or rejected, and why)."""
    if not (Path(run_dir) / "events.jsonl").exists() and not (Path(run_dir) / "ftkit").is_dir():
        raise UserError(Problem("not an ftkit run directory (no events.jsonl)", file=run_dir))
    s = summarize(run_dir, checksums=verify)
    if as_json:
        click.echo(json.dumps(s.as_dict(), indent=2, default=str))
    else:
        click.echo(format_summary(s))
    if plot:
        if not s.losses:
            raise UserError(Problem("no losses recorded yet: nothing to plot", file=run_dir))
        click.echo(f"wrote {plot_losses(s, Path(plot))}")
