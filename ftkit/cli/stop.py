"""ftkit stop: stop a live run from any shell."""

from __future__ import annotations

import sys

import click


@click.command(
    "stop",
    epilog="""\b
Examples:
  ftkit stop runs/demo            # SIGTERM to its ftkit launch, wait until nothing of the run is left
  ftkit stop runs/demo --force    # its supervisor is gone: tear the ranks down by their pid records
\b
Exit codes: 0 nothing of the run is left, 2 not a run directory, 11 something is still running.
""",
)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--force", is_flag=True, help="Tear down by pid records on every host when the supervisor is gone.")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds to wait for the run to end.")
def command(run_dir: str, force: bool, timeout: float) -> None:
    """Stop the run in RUN_DIR: signal its supervisor (which tears everything down), or with --force its ranks."""
    from ..owner import stop_run

    sys.exit(stop_run(run_dir, force=force, timeout=timeout, echo=click.echo))
