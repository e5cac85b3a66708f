"""ftkit stop: stop a live run from any shell."""

from __future__ import annotations

import sys

import click

from ftkit.cli.options import ssh_config_option
from ftkit.run.ownership import stop_run


@click.command(
    "stop",
    epilog="""\b
Examples:
  ftkit stop runs/demo            # its ftkit launch saves the step in flight, stops (exit 8); wait for it
  ftkit stop runs/demo --force    # stop at once without saving; or, its supervisor gone, by pid records
\b
Exit codes: 0 nothing of the run is left, 2 not a run directory, 11 something is still running.
""",
)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=str))
@click.option(
    "--force", is_flag=True, help="Stop at once without saving; tear down by pid records when the supervisor is gone."
)
@click.option(
    "--timeout",
    type=float,
    default=180.0,
    show_default=True,
    help="Seconds to wait for the run to end (a graceful stop takes up to resilience.stop_timeout_s).",
)
@ssh_config_option
def command(run_dir: str, force: bool, timeout: float, ssh_config: str | None) -> None:
    """Stop the run in RUN_DIR: its supervisor saves the step in flight and tears everything down (exit 8 there)."""

    sys.exit(stop_run(run_dir, force=force, timeout=timeout, echo=click.echo, ssh_config=ssh_config))
