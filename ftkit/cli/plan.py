"""ftkit plan: parameter counts, per-GPU memory of every ZeRO candidate, and the choice (with reasons)."""

from __future__ import annotations

import json
import sys

import click

from ftkit.cli.options import json_option, overrides_argument, recipe_argument
from ftkit.errors import ExitCode
from ftkit.plan.candidates import HEADROOM, full_table, plan_candidate
from ftkit.plan.comm import fmt_bytes
from ftkit.plan.load import load_and_plan
from ftkit.plan.tiers import local_tier_line

SHORT = {
    "weights": "weights",
    "gradients": "grads",
    "optimizer_states": "optim",
    "largest_layer": "gather",
    "prefetch": "prefetch",
    "activations": "activ",
    "logits": "logits",
    "comm_buckets": "buckets",
    "hpz_secondary": "hpZ",
    "margin": "margin",
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


@click.command(
    "plan",
    epilog="""\b
Examples:
  ftkit plan recipe.yaml
  ftkit plan recipe.yaml cluster.gpus_per_node=4 model.gradient_checkpointing=true
  ftkit plan recipe.yaml --json | jq .selected
\b
Exit codes: 0 the plan fits, 10 nothing fits (or the recipe's own choice does not; the table says what would),
2 bad recipe, hostfile or model config.
""",
)
@recipe_argument
@overrides_argument
@json_option
def command(recipe: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Print every ZeRO stage/offload candidate's memory per GPU (by component) and host RAM per node, whether
    it fits cluster.gpu_memory_gb with headroom, and the one the run uses (zero.stage: auto picks the fastest
    that fits; train.backend fsdp2 shows FSDP2's candidates, auto both backends')."""
    plan = load_and_plan(recipe, overrides, strict=False)
    rep = full_table(plan)
    data = rep.as_dict()
    data["plan"] = {
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
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
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
        f"gradient checkpointing {'on' if w.gradient_checkpointing else 'off'}"
        f"; limit {rep.gpu_memory_gb:g} GiB/GPU and {rep.host_memory_gb:g} GiB host RAM/node, "
        f"{HEADROOM:.0%} headroom"
    )
    chooser = plan.backend_report or plan.memory  # train.backend auto: the choice across both backends
    sel = chooser.selected if chooser is not None else None
    keys = list(dict.fromkeys(k for e in rep.choice.estimates for k in e.components))
    head = ["candidate", *(SHORT.get(k, k[:8]) for k in keys), "GiB/GPU", "host"]
    head += ["intra/step", "inter/step", "s/step", "tokens/s"]
    rows = []
    for e in rep.choice.estimates:
        cells = [e.candidate.label, *(f"{e.components.get(key, 0) / 2**30:.2f}" for key in keys)]
        cells += [f"{e.total_gb:.2f}", f"{e.host_ram_gb_per_node:.1f}"]
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
            f"\n(step time: {a['peak_tflops']:g} TFLOP/s peak ({a['gpu_doc']}, {a['gpu_source']}) "
            f"x MFU {a['mfu']:.0%}; "
            f"links {a['intra_node_gbs']:g} GB/s per GPU in a node, {a['inter_node_gbs']:g} GB/s per node across "
            f"({a['network_source']}); bytes per GPU per optimizer step as DeepSpeed's comms logger counts them)"
        )
    click.echo("\n(GiB; gather = ZeRO-3's gathered largest layer; host = host RAM per node)")
    label = (sel.candidate if sel is not None else plan_candidate(plan)).label
    click.echo(f"\nthis run: {label} ({'auto' if rep.auto else 'set in the recipe'}): {plan.sharding_why}")
    click.echo(local_tier_line(plan))
    if sel is not None and not sel.fits:
        click.echo(f"warning: {label} does not fit: {sel.reason}", err=True)
    if rep.suggestions:
        click.echo("\nnothing fits; what would:")
        for s in rep.suggestions:
            click.echo(f"  - {s}")
    if (sel is not None and not sel.fits) or (rep.auto and rep.choice.chosen is None):
        sys.exit(ExitCode.NOTHING_FITS)  # a finding (does not fit), not a usage error; 1 is `ftkit check` drift
