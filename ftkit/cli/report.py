"""ftkit report: one self-contained HTML page of a run directory."""

from __future__ import annotations

import click

from ftkit.report import write_report


@click.command(
    "report",
    epilog="""\b
The page: goodput and where the rest of the wall time went, loss and eval loss across
attempts (recomputed steps marked), a timeline of attempts per host, tokens/s, TFLOP/s
and MFU per attempt, compute time per host, every checkpoint (size, save time,
verification), and the plan against what was measured. Numbers come from events.jsonl
and metrics.jsonl, so any readable run directory works, live or finished. Inline SVG,
no script, no network request; prints well. ftkit launch refreshes RUN_DIR/report.html
after an attempt (at most once a minute) and when it ends, unless FTKIT_REPORT=off.

\b
Exit codes:
  0   the page was written
  2   RUN_DIR is not a readable ftkit run directory, or FILE cannot be written: its
      directory does not exist, it is part of a run's own state (never written, even
      with --force), or it exists and is not a report page (see --force)
  12  no space left on the device

\b
Examples:
  ftkit report runs/demo                     # writes runs/demo/report.html
  ftkit report runs/demo -o /tmp/demo.html
""",
)
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=str),
    default=None,
    help="Where to write the page (default: RUN_DIR/report.html). Its directory must exist.",
)
@click.option("--force", is_flag=True, help="Replace FILE even when it is not a page ftkit report wrote.")
def command(run_dir: str, out: str | None, force: bool) -> None:
    """Write one HTML page of RUN_DIR: goodput, loss, timeline, throughput, checkpoints, plan."""
    click.echo(f"wrote {write_report(run_dir, out, force=force)}")
