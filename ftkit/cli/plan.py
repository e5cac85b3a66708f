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
    columns = [(k, SHORT.get(k, k[:8])) for k in keys]
    width = max(56, *(len(e.candidate.label) + 1 for e in rep.choice.estimates))
    head = (
        f"{'candidate':<{width}}"
        + "".join(f"{short:>9}" for _, short in columns)
        + f"{'GiB/GPU':>9}{'host':>8}{'intra/step':>11}{'inter/step':>11}{'s/step':>9}{'tokens/s':>10}  verdict"
    )
    click.echo("\n" + head)
    click.echo("-" * len(head))
    for e in rep.choice.estimates:
        row = f"{e.candidate.label:<{width}}" + "".join(
            f"{e.components.get(key, 0) / 2**30:>9.2f}" for key, _ in columns
        )
        p = rep.predictions.get(e.candidate.label)
        if p is not None:
            t = p.traffic
            speed = (
                f"{fmt_bytes(t.by_scope('intra')):>11}{fmt_bytes(t.by_scope('inter')):>11}"
                f"{p.step_time_s:>9.3g}{p.tokens_per_s:>10,.0f}"
            )
        else:
            speed = f"{'':>41}"
        mark = "fits" if e.fits else "no"
        why = e.reason.removeprefix("fits: ") if e.fits else e.reason
        this = "  <- this run" if sel is not None and e.candidate == sel.candidate else ""
        click.echo(row + f"{e.total_gb:>9.2f}{e.host_ram_gb_per_node:>8.1f}{speed}  {mark}: {why}{this}")
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
