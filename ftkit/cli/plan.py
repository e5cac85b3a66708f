"""ftkit plan: parameter counts, per-GPU memory of every ZeRO candidate, step times, and the choice (with reasons)."""

from __future__ import annotations

import json
import sys

import click

from ftkit.cli.options import json_option, overrides_argument, recipe_argument
from ftkit.errors import ExitCode
from ftkit.plan.candidates import plan_candidate
from ftkit.plan.comm import fmt_bytes
from ftkit.plan.load import PlanReport, plan_report
from ftkit.plan.local_tier import local_tier_line
from ftkit.plan.parallel import layout_table, layouts_dict
from ftkit.plan.speed import expected_error_line
from ftkit.plan.types import HEADROOM, Plan
from ftkit.run.probe import probe_and_plan

SHORT = {
    "weights": "weights",
    "gradients": "grads",
    "optimizer_states": "optim",
    "largest_layer": "gather",
    "prefetch": "prefetch",
    "activations": "activ",
    "logits": "loss",
    "comm_buckets": "buckets",
    "hpz_secondary": "hpZ",
    "fsdp2_allowance": "fsdp2+",
    "reserved": "reserved",
    "context": "context",
}


def table(head: list[str], rows: list[tuple[list[str], str]]) -> list[str]:
    """The candidates' table: the label left-aligned, every number right-aligned in a column as wide as its widest
    cell, columns two spaces apart whatever the numbers (a tokens/s cell wider than its heading once ran into the
    s/step cell), the verdict last."""
    widths = [max(len(head[i]), *(len(cells[i]) for cells, _ in rows)) for i in range(len(head))]

    def line(cells: list[str], verdict: str) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)), verdict])

    out = [line(head, "verdict")]
    out.append("-" * len(out[0]))
    return out + [line(cells, verdict) for cells, verdict in rows]


def report_json(report: PlanReport) -> dict[str, object]:
    plan, rep = report.plan, report.table
    data = rep.as_dict()
    summary: dict[str, object] = {
        "backend": plan.recipe.train.backend,
        "stage": plan.stage,
        "offload_optimizer": plan.offload_optimizer,
        "offload_params": plan.offload_params,
        "world_size": plan.world_size,
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum": plan.grad_accum,
        "global_batch_size": plan.global_batch_size,
        "local_tier": plan.local_tier.to_json() if plan.local_tier else None,
        "local_tier_off": plan.local_tier_off or None,
    }
    data["plan"] = summary
    rows = layout_table(plan)
    if rows:
        summary.update(tp=plan.tp, sp=plan.sp, dp=plan.dp_size)
        data["layouts"] = layouts_dict(rows)
    cal = report.calibration
    data["calibration"] = cal.as_json() if cal is not None else None
    data["calibration_stored"] = report.stored or None
    return data


@click.command(
    "plan",
    epilog="""\b
Examples:
  ftkit plan recipe.yaml
  ftkit plan recipe.yaml cluster.gpus_per_node=4 model.gradient_checkpointing=true
  ftkit plan recipe.yaml --calibrate runs/first-try          # fit the step-time model to a measured run
  ftkit plan recipe.yaml --probe                             # measure the top candidates on one GPU first
  ftkit plan recipe.yaml --json | jq .selected
\b
Exit codes: 0 the plan fits, 10 nothing fits (or the recipe's own choice does not; the table says what would),
2 bad recipe, hostfile, model config or run directory.
""",
)
@recipe_argument
@overrides_argument
@json_option
@click.option(
    "--calibrate",
    "calibrate",
    multiple=True,
    type=click.Path(path_type=str),
    metavar="RUN_DIR",
    help="A run directory whose measured step times (metrics.jsonl) calibrate the step-time model; repeat for "
    "more. The calibration is kept beside this recipe's run directory for later plans.",
)
@click.option(
    "--probe",
    "probe",
    type=int,
    default=None,
    is_flag=False,
    flag_value=2,
    metavar="[N]",
    help="Run a few steps of the N fastest candidates that fit (default 2) on one GPU of this machine, then "
    "calibrate from them (as --calibrate).",
)
def command(
    recipe: str, overrides: tuple[str, ...], as_json: bool, calibrate: tuple[str, ...], probe: int | None
) -> None:
    """Print every ZeRO stage/offload candidate's memory per GPU (by component, at the phase of the step that peaks:
    allocator peak, reserved, device total with the CUDA context) and host RAM per node, its step time, whether it
    fits cluster.gpu_memory_gb with headroom, and the one the run uses (zero.stage: auto picks the fastest that fits;
    train.backend fsdp2 shows FSDP2's candidates, auto both backends')."""
    if probe is not None:
        report = probe_and_plan(recipe, overrides, top=probe, calibrate=calibrate, say=click.echo)
    else:
        report = plan_report(recipe, overrides, calibrate=calibrate)
    if as_json:
        click.echo(json.dumps(report_json(report), indent=2))
        return
    _print(report)


def _print(report: PlanReport) -> None:
    plan, rep = report.plan, report.table
    shape = rep.shape
    click.echo(
        f"model: {shape.family}, {shape.total_params:,} parameters ({rep.workload.phi:,} trainable), "
        f"hidden {shape.hidden_size}, {shape.num_layers} layers, {shape.num_heads} heads ({shape.num_kv_heads} kv), "
        f"vocab {shape.vocab_size:,}; counted {shape.source}"
    )
    w = rep.workload
    click.echo(
        f"workload: {w.world_size} ranks ({w.gpus_per_node} per node), micro batch {w.micro_batch_size}, "
        f"sequence {w.seq_len}, {w.precision}, "
        + (f"tp {w.tp} x sp {w.sp} x dp {plan.dp_size}, " if w.tp * w.sp > 1 else "")
        + f"gradient checkpointing {'on' if w.gradient_checkpointing else 'off'}"
        f"; limit {rep.gpu_memory_gb:g} GiB/GPU and {rep.host_memory_gb:g} GiB host RAM/node, "
        f"{HEADROOM:.0%} headroom"
    )
    if rep.activations:
        click.echo(rep.activations)
    chooser = plan.backend_report or plan.memory  # train.backend auto: the choice across both backends
    sel = chooser.selected if chooser is not None else None
    found = {k for e in rep.choice.estimates for k in e.components}
    keys = [k for k in SHORT if k in found] + sorted(found - set(SHORT))
    head = ["candidate", *(SHORT.get(k, k[:8]) for k in keys), "alloc", "GiB/GPU", "host"]
    head += ["intra/step", "inter/step", "s/step", "tokens/s"]
    rows = []
    for e in rep.choice.estimates:
        cells = [e.candidate.label, *(f"{e.components.get(key, 0) / 2**30:.2f}" for key in keys)]
        cells += [f"{e.allocator_bytes / 2**30:.2f}", f"{e.total_gb:.2f}", f"{e.host_ram_gb_per_node:.1f}"]
        p = rep.predictions.get(e.candidate.label)
        if p is not None:
            t = p.traffic
            cells += [fmt_bytes(t.by_scope("intra")), fmt_bytes(t.by_scope("inter"))]
            cells += [f"{p.step_time_s:.3g}", f"{p.tokens_per_s:,.0f}"]
        else:
            cells += ["", "", "", ""]
        mark = "fits" if e.fits else "no"
        why = e.reason.removeprefix("fits: ") if e.fits else e.reason
        this = "  <- this run" if sel is not None and e.candidate == sel.candidate else ""
        rows.append((cells, f"{mark}: {why}{this}"))
    click.echo("\n" + "\n".join(table(head, rows)))
    a = next(iter(rep.predictions.values())).assumptions if rep.predictions else None
    if a is not None:
        click.echo(
            f"\n(step time: GEMMs at their own sizes on {a['peak_tflops']:g} TFLOP/s ({a['gpu_doc']}, "
            f"{a['gpu_source']}), memory-bound work at {a['hbm_gbs']:g} GB/s, {a['launch_us']:g} us per kernel "
            f"launched and each engine's hooks; links {a['intra_node_gbs']:g} GB/s per GPU in a node, "
            f"{a['inter_node_gbs']:g} GB/s per node across ({a['network_source']}); bytes per GPU per optimizer step "
            "as DeepSpeed's comms logger counts them)"
        )
        click.echo(expected_error_line(report.calibration, str(a["gpu"])))
    for point in report.measured:
        c = report.calibration
        pred = point.predicted(c.gpu_scale, c.host_scale) if c is not None else point.predicted(1.0, 1.0)
        raw = point.predicted(1.0, 1.0)
        click.echo(
            f"  {point.run}: {point.label} measured {point.measured_s:.3g} s/step (median of {point.steps}); "
            f"predicted {pred:.3g} s ({(pred - point.measured_s) / point.measured_s:+.0%}), uncalibrated "
            f"{raw:.3g} s ({(raw - point.measured_s) / point.measured_s:+.0%})"
        )
    if report.stored:
        click.echo(f"calibration kept in {report.stored}")
    click.echo(
        "\n(GiB at the peak of a step; gather = ZeRO-3's gathered largest layer; loss = the loss's fp32 logits and "
        "temporaries; alloc = the allocator's peak; GiB/GPU = the device total with reserved and the CUDA context; "
        "host = host RAM per node)"
    )
    _print_layouts(plan)
    label = (sel.candidate if sel is not None else plan_candidate(plan)).label
    click.echo(f"\nthis run: {label} ({'auto' if rep.auto else 'set in the recipe'}): {plan.sharding_why}")
    click.echo(local_tier_line(plan.local_tier, plan.local_tier_off))
    if sel is not None and not sel.fits:
        click.echo(f"warning: {label} does not fit: {sel.reason}", err=True)
    if rep.suggestions:
        click.echo("\nnothing fits; what would:")
        for s in rep.suggestions:
            click.echo(f"  - {s}")
    if (sel is not None and not sel.fits) or (rep.auto and rep.choice.chosen is None):
        sys.exit(ExitCode.NOTHING_FITS)  # a finding (does not fit), not a usage error; 1 is `ftkit check` drift


def _print_layouts(plan: Plan) -> None:
    """A recipe with a ``parallel`` section: every tensor/sequence-parallel layout with its best candidate, memory,
    step time and the longest sequence it fits."""
    rows = layout_table(plan)
    if not rows:
        return
    head = ["layout", "accum", "GiB/GPU", "s/step", "tokens/s", "longest seq"]
    lines = []
    for row in rows:
        cells = [row.label, str(row.grad_accum), f"{row.gpu_gb:.2f}", f"{row.step_time_s:.3g}"]
        cells += [f"{row.tokens_per_s:,.0f}", f"{row.longest_seq:,}" if row.longest_seq else "none"]
        this = "  <- this run" if (row.tp, row.sp) == (plan.tp, plan.sp) else ""
        verdict = "fits: " + row.reason.removeprefix("fits: ") if row.fits else "no: " + row.reason
        lines.append((cells, f"{row.candidate}; {verdict}{this}"))
    click.echo(
        f"\nlayouts (tensor x sequence x data parallel; each with its fastest candidate that fits; longest seq: the "
        f"longest data.max_seq_len it fits at micro batch {plan.micro_batch_size}):"
    )
    click.echo("\n".join(table(head, lines)))
    why = plan.knobs.get("sequence_parallel_size") if plan.recipe.parallel.sp == "auto" else None
    why = why or plan.knobs.get("tensor_parallel_size")
    if why is not None:
        click.echo(f"layout: tp {plan.tp} x sp {plan.sp} x dp {plan.dp_size}: {why.why}")
