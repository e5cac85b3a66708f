"""ftkit submit: parse the command line and call :func:`ftkit.run.submit.submit`."""

from __future__ import annotations

import sys

import click

from ftkit.cli.options import AfterDashes, after_dashes, overrides_argument, recipe_argument
from ftkit.run.submit import SubmitRequest, submit


@click.command(
    "submit",
    cls=AfterDashes,
    epilog="""\b
Examples:
  ftkit submit recipe.yaml --nodes 2 --time 4:00:00 --partition gpu   # sbatch it; prints the job id
  ftkit submit recipe.yaml --dry-run                  # print RUN/slurm/submit.sbatch, submit nothing
  ftkit submit recipe.yaml -- --qos=high --exclusive  # more sbatch options, passed as they are
\b
The job runs ftkit launch on the first node; srun starts torchrun on every node (no ssh, no hostfile). Slurm's
USR1 before the time limit or on preemption: the step in flight is saved, then `scontrol requeue` (at most
resilience.max_requeues times); the requeued job resumes from that step. Output: RUN/slurm/job-JOBID.out.
\b
Exit codes: 0 submitted (or --dry-run), 2 bad recipe or option, or sbatch refused the job.
""",
)
@recipe_argument
@overrides_argument
@click.option("--nodes", type=int, default=None, help="Nodes to allocate (default: cluster.num_nodes).")
@click.option("--time", "time_limit", default=None, help="Time limit, in sbatch's form (e.g. 4:00:00).")
@click.option("--partition", default=None, help="Slurm partition.")
@click.option("--account", default=None, help="Slurm account to charge.")
@click.option("--dry-run", is_flag=True, help="Print the batch script and the sbatch command; submit nothing.")
@click.pass_context
def command(
    ctx: click.Context,
    recipe: str,
    overrides: tuple[str, ...],
    nodes: int | None,
    time_limit: str | None,
    partition: str | None,
    account: str | None,
    dry_run: bool,
) -> None:
    """Submit RECIPE as a Slurm batch job that saves on Slurm's notice and requeues itself."""

    req = SubmitRequest(
        recipe=recipe,
        overrides=overrides,
        nodes=nodes,
        time=time_limit,
        partition=partition,
        account=account,
        sbatch_args=after_dashes(ctx) or (),
        dry_run=dry_run,
    )
    sys.exit(submit(req, echo=click.echo))
