"""ftkit launch: render, preflight, start on an existing engine, supervise and restart from committed checkpoints."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..checkpoints import select_resume
from ..command import LaunchInputs, build_launch, describe
from ..configs import load_and_plan
from ..plan import Plan, build_plan
from .options import (
    cli_overrides,
    engine_option,
    exclude_option,
    hostfile_option,
    include_option,
    overrides_argument,
    recipe_argument,
)


def launch_inputs(plan: Plan, attempt: int = 0, resume: str | None = None) -> LaunchInputs:
    r = plan.recipe
    return LaunchInputs(
        engine=r["cluster.engine"],
        hosts=tuple(plan.hosts),
        master_addr=plan.master_addr,
        master_port=plan.master_port,
        run_dir=str(Path(r["train.output_dir"]).resolve()),
        attempt=attempt,
        resume=resume,
        accelerator=r["cluster.accelerator"],
        python=sys.executable,
        name=r["name"],
        ssh_config=r["cluster.ssh_config"],
        devices=dict(plan.devices),
    )


def plan_summary(plan: Plan) -> str:
    hosts = ", ".join(f"{h} ({n})" for h, n in plan.hosts)
    off = f", optimizer offload {plan.offload_optimizer}" if plan.offload_optimizer != "none" else ""
    off += f", parameter offload {plan.offload_params}" if plan.offload_params != "none" else ""
    r = plan.recipe
    steps = f"{r['train.max_steps']} steps" if r["train.max_steps"] else f"{r['train.epochs']} epochs"
    return (
        f"plan: {r['cluster.engine']} on {plan.num_nodes} node(s): {hosts}; world size {plan.world_size}; "
        f"ZeRO-{plan.stage}{off}; batch {plan.global_batch_size} = micro {plan.micro_batch_size} x accum "
        f"{plan.grad_accum} x {plan.world_size} ranks; {steps}; {'LoRA' if r.has_peft else 'full fine-tuning'}, "
        f"{r['train.precision']}\nrun directory: {r['train.output_dir']}"
    )


@click.command(
    "launch",
    epilog="""\b
Examples:
  ftkit launch recipe.yaml                               # this machine
  ftkit launch recipe.yaml --hostfile hostfile           # several hosts (ssh/pdsh)
  ftkit launch recipe.yaml --engine torchrun --dry-run   # print per-node argv and env, start nothing
  ftkit launch recipe.yaml train.max_steps=2000          # continue a finished run for more steps
\b
Exit codes: 0 success, 2 bad recipe/hostfile/data, 3 preflight failed, 4 restart budget exhausted,
5 no valid checkpoint, 6 training failed otherwise, 7 host lost (cluster.min_nodes), 130/143 interrupted.
""",
)
@recipe_argument
@overrides_argument
@hostfile_option
@include_option
@exclude_option
@engine_option
@click.option(
    "--dry-run", is_flag=True, help="Print the plan and the exact per-node argv and environment; start nothing."
)
def command(
    recipe: str,
    overrides: tuple[str, ...],
    hostfile: str | None,
    include: str | None,
    exclude: str | None,
    engine: str | None,
    dry_run: bool,
) -> None:
    """Launch RECIPE: validate, plan, render into the run directory, preflight, start, supervise, recover."""
    plan = load_and_plan(recipe, cli_overrides(overrides, hostfile, engine), include=include, exclude=exclude)
    click.echo(plan_summary(plan))
    r = plan.recipe
    ssh_args = ["-F", r["cluster.ssh_config"]] if r["cluster.ssh_config"] else []
    if dry_run:
        run_dir = Path(r["train.output_dir"])
        sel = select_resume(run_dir, world_size=plan.world_size, stage=plan.stage) if run_dir.exists() else None
        resume = str(sel.chosen) if sel and sel.chosen else None
        from ..rundir import RunDir

        attempt = RunDir(run_dir).next_attempt()
        click.echo(describe(build_launch(launch_inputs(plan, attempt, resume), dict(os.environ))))
        return
    from ..preflight import run_preflight
    from ..prepare import prepare_run
    from ..rundir import RunDir
    from ..supervise import Supervisor

    data = Path(r["data.train"])
    if not data.is_file():
        from ..errors import RecipeError

        what = "is a directory, expected a file" if data.is_dir() else "file not found"
        raise RecipeError(r.problem("data.train", f"{data}: {what}"))
    rd = RunDir(r["train.output_dir"])
    report = run_preflight(
        hosts=plan.hosts,
        master_addr=plan.master_addr,
        master_port=plan.master_port,
        run_dir=rd.path,
        engine=r["cluster.engine"],
        ssh_args=ssh_args,
    )
    prepare_run(plan)
    sup = Supervisor(
        rd=rd,
        inputs=launch_inputs(plan),
        base_env=dict(os.environ),
        resilience={k.split(".", 1)[1]: v for k, v in r.values.items() if k.startswith("resilience.")},
        stage=plan.stage,
        world_size=plan.world_size,
        max_steps=r["train.max_steps"],
        ssh_args=ssh_args,
        echo=lambda s: click.echo(s),
        min_nodes=r["cluster.min_nodes"],
        replan=lambda hosts: build_plan(r, hosts=hosts),
        prepare=lambda p, universal: prepare_run(p, load_universal=universal),
    )
    sup.events.attempt = sup.next_attempt()
    sup.events("preflight", "preflight passed: " + "; ".join(report.checks), versions=report.versions)
    code = sup.run()
    from ..runstatus import format_summary, summarize

    click.echo(format_summary(summarize(rd.path)))
    sys.exit(code)
