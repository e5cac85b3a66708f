"""ftkit doctor: check every host of RECIPE's cluster, then a real rendezvous and all-reduce across them."""

from __future__ import annotations

import json

import click

from ftkit.cli.options import cli_overrides, hostfile_option, json_option, overrides_argument, recipe_argument
from ftkit.errors import PreflightError
from ftkit.plan.load import load_and_plan
from ftkit.run.doctor import run_doctor
from ftkit.run.doctor_checks import format_report
from ftkit.run.job import ssh_args_of


@click.command(
    "doctor",
    epilog="""\b
Checks, on every host in parallel: what `ftkit launch` preflight checks (ssh, run directory, master port,
versions), the same ftkit/python/torch/deepspeed/transformers versions as this machine, GPU model and driver
(cuda), free space in the run directory, /dev/shm size and free space, clock skew, the network interface the
collectives use (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / the route to master_addr), stale torch extension build
locks; then a rendezvous and all-reduce across all hosts with the engine's backend (gloo on cpu, nccl on cuda),
bounded by a short timeout, naming the hosts that did not join and why.
\b
Exit codes: 0 every check passed; 2 bad recipe, hostfile or command line; 3 a check failed (one line per
failure on stderr, with the fix).
\b
Examples:
  ftkit doctor recipe.yaml
  ftkit doctor recipe.yaml --hostfile hostfile --bandwidth   # + all-reduce bus bandwidth, recorded for ftkit plan
  ftkit doctor recipe.yaml --json
""",
)
@recipe_argument
@overrides_argument
@hostfile_option
@click.option(
    "--bandwidth",
    is_flag=True,
    help="Also measure all-reduce bus bandwidth across all hosts and between pairs; record it for ftkit plan.",
)
@json_option
def command(recipe: str, overrides: tuple[str, ...], hostfile: str | None, bandwidth: bool, as_json: bool) -> None:
    """Find the host that would break a multi-node start of RECIPE, in seconds, before launching anything."""

    plan = load_and_plan(recipe, tuple(cli_overrides(overrides, hostfile)))
    report = run_doctor(plan, ssh_args=ssh_args_of(plan), bandwidth=bandwidth)
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else format_report(report))
    if not report.ok:
        raise PreflightError("\n".join(f.line() for f in report.failures))
