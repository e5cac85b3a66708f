"""ftkit status: what happened in a run directory."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ftkit.cli.options import json_option, ssh_config_option
from ftkit.errors import Problem, UserError
from ftkit.run.ownership import liveness
from ftkit.run.status import VerifyFailed, format_summary, plot_losses, plot_target, summarize


@click.command(
    "status",
    epilog="""\b
Exit codes:
  0   summary printed (with --verify: every checkpoint-N and final/ verifies)
  2   RUN_DIR is not a readable ftkit run directory, ftkit/spec.json or a log is damaged,
      or --plot cannot be written (one line naming the path): its directory does not
      exist, it is part of a run's own state, or it exists and is not a plot ftkit
      wrote (see --force)
  12  --plot: no space left on the device
  13  --verify: a checkpoint-N or final/ failed verification (printed after the summary;
      copies a restart set aside as checkpoint-N.rejected-* do not count)
Malformed lines in events.jsonl or metrics.jsonl (not a JSON object, no numeric step or
loss) are skipped and counted in a note; the summary still prints.
A host whose ranks compute each step at least 1.5x slower than the other hosts' median
(after 10 steps; from the heartbeats) is named on a "straggler:" line with its numbers.

\b
Examples:
  ftkit status runs/demo
  ftkit status runs/demo --plot loss.png     # loss and eval loss against step, restarts marked
  ftkit status runs/demo --verify --json     # re-read every checkpoint byte; exit 13 if any fails
""",
)
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option(
    "--plot",
    type=click.Path(path_type=str),
    default=None,
    help="Write a PNG of loss (and eval loss) against step with each restart marked; steps a failed attempt "
    "computed and a later one recomputed are drawn too, lighter.",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Re-read every file of every checkpoint and of final/ against its recorded checksum; exit 13 if any fails.",
)
@click.option("--force", is_flag=True, help="--plot: replace the file even when it is not a plot ftkit wrote.")
@ssh_config_option
@json_option
def command(run_dir: str, plot: str | None, verify: bool, force: bool, ssh_config: str | None, as_json: bool) -> None:
    """Summarise RUN_DIR: attempts, restarts, current step, loss and eval loss, checkpoints (committed or rejected,
    and why), Slurm job events, straggling hosts."""
    path = Path(run_dir)
    if not path.exists():
        raise UserError(Problem("does not exist [give the run's train.output_dir]", file=run_dir))
    if not path.is_dir():
        raise UserError(Problem("not a directory [give the run's train.output_dir]", file=run_dir))
    if not (path / "events.jsonl").exists() and not (path / "ftkit").is_dir():
        raise UserError(Problem("not an ftkit run directory (no events.jsonl)", file=run_dir))
    target = plot_target(plot, force) if plot else None
    s = summarize(run_dir, checksums=verify)
    s.running = liveness(run_dir, ssh_config)
    if as_json:
        click.echo(json.dumps(s.as_dict(), indent=2, default=str))
    else:
        click.echo(format_summary(s))
    if target is not None:
        if not s.losses:
            raise UserError(Problem("no losses recorded yet: nothing to plot", file=run_dir))
        click.echo(f"wrote {plot_losses(s, target)}")
    if verify and (failures := s.verify_failures):
        more = f" (and {len(failures) - 1} more, listed above)" if len(failures) > 1 else ""
        raise VerifyFailed(f"{run_dir}: verification failed: {failures[0]}{more}")
