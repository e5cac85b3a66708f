"""Tensor and sequence parallelism in the plan: the layouts a recipe allows, how each fits and runs, and ``auto``.

A layout is ``tp`` x ``sp`` x ``dp`` = the world size: ``tp`` ranks of a node split every layer (DeepSpeed AutoTP,
or FSDP2 with Accelerate's ``tp_size``), ``sp`` ranks split every sequence (DeepSpeed's Ulysses/ALST), and the
data-parallel degree ``dp`` alone multiplies the micro batch: global batch = micro x grad_accum x dp. The memory and
step-time model is the data-parallel one with the layout in its :class:`~ftkit.plan.memory.Workload` (activations
of seq_len / sp tokens, the 1/tp of each layer sharded over the dp ranks; TP's all-reduces and SP's all-to-alls on
the intra-node links, :func:`ftkit.plan.comm.parallel_collectives`).

``parallel.tp`` / ``parallel.sp: auto`` judge every valid layout with the recipe's sharding candidates and keep data
parallelism alone unless it does not fit, or another layout that fits is predicted :data:`LAYOUT_MARGIN` faster.
``ftkit plan`` prints the rows, each with the longest sequence its candidate fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ftkit.errors import RecipeError
from ftkit.plan.candidates import plan_memory
from ftkit.plan.memory import Candidate, Estimate, Workload, estimate, judge
from ftkit.plan.types import HEADROOM, LayoutRow, MemoryReport, Plan
from ftkit.recipe.load import CLI, DEFAULT, Recipe
from ftkit.recipe.rules import LayoutFacts, layout_problems, parallel_problems
from ftkit.rundir.records import JSONObject, as_int

# another layout must be predicted this much faster than data parallelism alone (which fits) to be chosen: TP's
# and SP's collectives sit on the critical path, and the model of them is not calibrated yet
LAYOUT_MARGIN = 0.10
LONGEST_CAP = 1 << 22  # the longest sequence searched (4M tokens)


def layout_facts(recipe: Recipe, hosts: list[tuple[str, int]], cfg: Mapping[str, object]) -> LayoutFacts:
    """What :func:`ftkit.recipe.rules.layout_problems` needs besides the degrees: the backend, the hosts' slots, the
    model's heads (the text model's, for a multimodal config) and attention implementation."""
    text = cfg.get("text_config")
    src = text if isinstance(text, dict) and "num_attention_heads" in text else cfg
    heads = as_int(src.get("num_attention_heads"))  # type: ignore[arg-type]
    kv = as_int(src.get("num_key_value_heads"))  # type: ignore[arg-type]
    attn = str(cfg.get("_attn_implementation") or cfg.get("attn_implementation") or "")
    return LayoutFacts(
        backend=recipe.train.backend,
        slots=[n for _, n in hosts],
        heads=heads,
        kv_heads=kv if kv is not None else heads,
        attn_implementation=attn,
    )


def note_layout(plan: Plan, tp_why: str, sp_why: str) -> None:
    """The layout's knobs, with where each degree came from."""
    micro, gbs, world = plan.micro_batch_size, plan.global_batch_size, plan.world_size
    plan.note("tensor_parallel_size", plan.tp, tp_why)
    plan.note("sequence_parallel_size", plan.sp, sp_why)
    plan.note("data_parallel_size", plan.dp_size, f"world {world} / (tp {plan.tp} x sp {plan.sp})")
    plan.note(
        "gradient_accumulation_steps",
        plan.grad_accum,
        f"global_batch_size {gbs} / (micro {micro} x data-parallel {plan.dp_size})",
    )


def layout_options(plan: Plan, *, every: bool = False) -> list[tuple[int, int]]:
    """Every (tp, sp) the recipe and the cluster allow: a fixed degree stays fixed (``every``: it too is open, for
    ``ftkit plan``'s comparison), ``auto`` tries the divisors of a node's ranks; TP and SP are not combined; each
    layout's batch must divide. Data parallelism alone first."""
    r = plan.recipe
    per_node = min(n for _, n in plan.hosts)
    divisors = [d for d in range(1, per_node + 1) if per_node % d == 0]
    tps = [r.parallel.tp] if isinstance(r.parallel.tp, int) and not every else divisors
    sps = [r.parallel.sp] if isinstance(r.parallel.sp, int) and not every else divisors
    facts = layout_facts(r, plan.hosts, plan.model_config)
    out: list[tuple[int, int]] = []
    for tp in tps:
        for sp in sps:
            values = dict(r.values)
            values.update({"parallel.tp": tp, "parallel.sp": sp})
            if parallel_problems(values) or layout_problems(tp, sp, **facts):
                continue
            dp = plan.world_size // (tp * sp)
            if plan.global_batch_size % (plan.micro_batch_size * dp):
                continue
            out.append((tp, sp))
    return sorted(out, key=lambda ts: (ts[0] * ts[1], ts[0]))


def longest_seq(c: Candidate, w: Workload, gpu_gb: float, host_gb: float | None) -> int:
    """The longest sequence (tokens, a multiple of 128 x sp) candidate ``c`` fits at the workload's micro batch;
    0 when not even the shortest does."""
    unit = 128 * w.sp

    def fits(s: int) -> bool:
        return judge(estimate(c, dataclasses.replace(w, seq_len=s)), gpu_gb, host_gb, HEADROOM).fits

    if not fits(unit):
        return 0
    lo, hi = unit, 2 * unit
    while hi <= LONGEST_CAP and fits(hi):
        lo, hi = hi, 2 * hi
    if hi > LONGEST_CAP:
        return lo
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def evaluate(plan: Plan, tp: int, sp: int) -> tuple[LayoutRow, MemoryReport]:
    """One layout judged with the recipe's sharding candidates (``auto``: the fastest that fits)."""
    dp = plan.world_size // (tp * sp)
    trial = dataclasses.replace(
        plan, tp=tp, sp=sp, grad_accum=plan.global_batch_size // (plan.micro_batch_size * dp), knobs={}, layouts=[]
    )
    rep = plan_memory(trial)
    est: Estimate | None = rep.choice.chosen if rep.auto else rep.selected
    if est is None:  # nothing fits: the candidate that needs the least memory, for its numbers and longest sequence
        est = min(rep.choice.estimates, key=lambda e: e.total_gb)
    pred = rep.predictions.get(est.candidate.label)
    longest = longest_seq(est.candidate, rep.workload, rep.gpu_memory_gb, rep.host_memory_gb)
    row = LayoutRow(
        tp=tp,
        sp=sp,
        dp=dp,
        grad_accum=trial.grad_accum,
        candidate=est.candidate.label,
        gpu_gb=est.total_gb,
        fits=est.fits,
        step_time_s=pred.step_time_s if pred is not None else 0.0,
        tokens_per_s=pred.tokens_per_s if pred is not None else 0.0,
        longest_seq=longest,
        reason=est.reason,
    )
    return row, rep


def choose_layout(rows: list[LayoutRow]) -> tuple[LayoutRow | None, str]:
    """Data parallelism alone when it fits, unless a layout that fits is predicted :data:`LAYOUT_MARGIN` faster;
    else the fastest layout that fits; None when none does."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None, "no layout fits"
    fastest = min(fitting, key=lambda r: r.step_time_s)
    base = next((r for r in fitting if r.tp == r.sp == 1), None)
    if base is None:
        return fastest, (
            f"{fastest.label} is the fastest layout that fits ({fastest.gpu_gb:.1f} GiB per GPU, "
            f"{fastest.step_time_s:.3g} s/step); data parallelism alone does not fit"
        )
    if fastest is not base and fastest.step_time_s < base.step_time_s * (1 - LAYOUT_MARGIN):
        return fastest, (
            f"{fastest.label} is predicted {1 - fastest.step_time_s / base.step_time_s:.0%} faster than data "
            f"parallelism alone ({fastest.step_time_s:.3g} vs {base.step_time_s:.3g} s/step; it must win by "
            f"{LAYOUT_MARGIN:.0%})"
        )
    return base, (
        f"data parallelism alone fits ({base.gpu_gb:.1f} GiB per GPU, {base.step_time_s:.3g} s/step) and no layout "
        f"is {LAYOUT_MARGIN:.0%} faster"
    )


def resolve_layout(plan: Plan, *, with_memory: bool, strict: bool) -> None:
    """``parallel.tp`` / ``parallel.sp: auto``: judge every layout (:func:`layout_options`), keep them in
    ``plan.layouts`` (the chosen first) and give the plan the chosen degrees and batch arithmetic."""
    r = plan.recipe
    key = "parallel.tp" if r.parallel.tp == "auto" else "parallel.sp"
    if not with_memory or plan.unknown:
        raise RecipeError(r.problem(key, "auto needs the model's config to plan the layouts: set a degree"))
    options = layout_options(plan)
    if not options:
        raise RecipeError(
            r.problem(key, "auto: no tensor/sequence-parallel layout is valid for this model, cluster and batch")
        )
    rows = [evaluate(plan, tp, sp)[0] for tp, sp in options]
    chosen, why = choose_layout(rows)
    if chosen is None:
        if strict:
            raise RecipeError(
                r.problem(
                    key,
                    "auto: nothing fits under any layout ("
                    + "; ".join(f"{row.label}: {row.reason}" for row in rows)
                    + "); run `ftkit plan`",
                )
            )
        chosen = rows[0]
    plan.layouts = [chosen, *(row for row in rows if row is not chosen)]
    plan.tp, plan.sp, plan.grad_accum = chosen.tp, chosen.sp, chosen.grad_accum
    auto = f"auto: {why}"
    tp_why = auto if r.parallel.tp == "auto" else _src(r, "parallel.tp")
    sp_why = auto if r.parallel.sp == "auto" else _src(r, "parallel.sp")
    note_layout(plan, tp_why, sp_why)


def layout_table(plan: Plan) -> list[LayoutRow]:
    """``ftkit plan``'s comparison of layouts, for a recipe with a ``parallel`` section: the rows ``auto`` judged,
    else every valid layout (the recipe's own first); none without the section."""
    r = plan.recipe
    if not {"parallel.tp", "parallel.sp"} & r.explicit:
        return []
    if plan.layouts:
        return plan.layouts
    rows = [evaluate(plan, tp, sp)[0] for tp, sp in layout_options(plan, every=True)]
    own = [row for row in rows if (row.tp, row.sp) == (plan.tp, plan.sp)]
    return own + [row for row in rows if row not in own]


def layouts_dict(rows: list[LayoutRow]) -> list[JSONObject]:
    """``ftkit plan --json``'s layouts."""
    return [
        {
            "layout": row.label,
            "tp": row.tp,
            "sp": row.sp,
            "dp": row.dp,
            "grad_accum": row.grad_accum,
            "candidate": row.candidate,
            "gpu_gib": round(row.gpu_gb, 3),
            "fits": row.fits,
            "step_time_s": round(row.step_time_s, 6),
            "tokens_per_s": round(row.tokens_per_s, 1),
            "longest_seq": row.longest_seq,
            "reason": row.reason,
        }
        for row in rows
    ]


def _src(recipe: Recipe, key: str) -> str:
    s = recipe.sources.get(key, DEFAULT)
    return "recipe default" if s == DEFAULT else ("command line" if s == CLI else s)
