"""Memory planning for a recipe: the Workload from the plan, every candidate's estimate, and the choice.

:mod:`ftkit.plan.memory` is the arithmetic; this module ties it to a recipe: parameter counts from the model's
config.json (closed form, or the meta device for unknown families), LoRA trainable parameters from ``peft``,
the batch, sequence length and buckets from the plan. ``zero.stage: auto`` / ``zero.offload_optimizer: auto``
take the fastest candidate that fits ``cluster.gpu_memory_gb`` with :data:`HEADROOM` to spare, fastest by the step
time :mod:`ftkit.plan.comm` predicts (compute + exposed communication on the recipe's network; ZeRO++ candidates across
nodes, with a margin; the order of docs/design.md, Memory planning, breaks ties); fixed choices are estimated too, so
``ftkit plan`` can warn when they will not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

from ftkit.errors import RecipeError, UserError
from ftkit.model.shape import ModelShape, count_params, lora_tensors, lora_trainable_params
from ftkit.plan.comm import (
    ZEROPP_MARGIN,
    Network,
    Prediction,
    ZeroPP,
    predict,
    ranking_time,
    resolve_gpu,
    resolve_network,
    zeropp_candidates,
    zeropp_memory_bytes,
)
from ftkit.plan.knobs import overlap_comm_auto, persistence_threshold
from ftkit.plan.memory import (
    PRECISION_BYTES,
    RESERVED_FACTOR,
    Candidate,
    Choice,
    Estimate,
    Workload,
    candidates,
    choose,
    estimate,
    estimate_all,
    fsdp2_candidate,
    fsdp2_candidates,
    judge,
    suggestions,
)
from ftkit.plan.speed import Calibration
from ftkit.plan.types import HEADROOM, MemoryReport, Plan
from ftkit.recipe.load import Recipe
from ftkit.rundir.records import as_int

_D = TypeVar("_D", int, None)


@dataclass(frozen=True)
class PlanContext:
    """What the predictions for one plan share: the network, the GPU, the LoRA tensor sizes."""

    gpu: str  # GPU_PEAK_TFLOPS's key
    gpu_source: str
    net: Network
    lora_tensors: list[int] | None
    calibration: Calibration | None = None
    cpu_adam: bool = True  # offload steps with DeepSpeed's CPU Adam (else torch's AdamW on the CPU)


TIGHT = 0.80  # above this share of the (headroom-reduced) limit, memory counts as tight for buffer sizing


def model_shape(plan: Plan) -> ModelShape:
    """The parameter counts gathered with the plan's inputs, else the closed form (no I/O: a family without one
    needs the inputs gathered with memory, :func:`ftkit.plan.inputs.gather`)."""
    if plan.inputs is not None and plan.inputs.shape is not None:
        return plan.inputs.shape
    shape = count_params(plan.model_config, source=plan.model_config_label or "config.json")
    if shape is None:
        raise ValueError("the model's family has no closed-form parameter count (run `ftkit plan` for it)")
    return shape


def _size(value: int | str) -> int | None:
    """A size key of the ``zero`` section: None for ``auto`` (the planner's own default)."""
    return None if value == "auto" else int(value)


def plan_memory(plan: Plan) -> MemoryReport:
    r = plan.recipe
    shape = model_shape(plan)
    lora = None
    if r.peft is not None:
        try:
            lora = lora_trainable_params(shape, r.peft.r, r.peft.target_modules)
        except UserError as e:
            raise RecipeError([r.problem("peft.target_modules", p.message) for p in e.problems]) from None
    live = _size(r.zero.max_live_parameters)
    w = Workload(
        shape=shape,
        world_size=plan.world_size,
        gpus_per_node=max(n for _, n in plan.hosts),
        micro_batch_size=plan.micro_batch_size,
        seq_len=r.data.max_seq_len,
        precision=r.train.precision,
        lora_params=lora,
        gradient_checkpointing=r.model.gradient_checkpointing,
        reduce_bucket_size=_size(r.zero.reduce_bucket_size),
        stage3_prefetch_bucket_size=_size(r.zero.prefetch_bucket_size),
        stage3_max_live_parameters=Workload.stage3_max_live_parameters if live is None else live,
        pin_memory=r.cluster.accelerator != "cpu",
        grad_accum=plan.grad_accum,
        accelerator=r.cluster.accelerator,
        profile=plan.inputs.profile if plan.inputs is not None else None,
        profile_zero3=plan.inputs.profile_zero3 if plan.inputs is not None else None,
        lora_dropout=float(r.peft.dropout) if r.peft is not None else 0.0,
        eager_attention=str(plan.model_config.get("_attn_implementation") or "") == "eager",
        tp=plan.tp,
        sp=plan.sp,
    )
    gpu, host = float(r.cluster.gpu_memory_gb), float(r.cluster.host_memory_gb)
    stage, opt, par = r.zero.stage, r.zero.offload_optimizer, r.zero.offload_params
    auto = stage == "auto" or opt == "auto"
    # auto picks among the candidates the recipe leaves open: a fixed stage or offload stays fixed; parameter
    # offload is open only when the recipe did not set it; NVMe only when there is an nvme_path.
    par_open = stage == "auto" and "zero.offload_params" not in r.explicit
    allowed = [
        c
        for c in candidates(include_stage0=plan.dp_size == 1, include_nvme=bool(r.zero.nvme_path))
        if (stage == "auto" or c.stage == stage)
        and not (plan.tp > 1 and c.stage == 3)  # DeepSpeed AutoTP under HF Trainer: ZeRO 0-2 (ftkit.recipe.rules)
        and (opt == "auto" or c.offload_optimizer == opt)
        and (par_open or c.offload_params == par)
    ]
    if stage in ("auto", 3) and opt in ("auto", "none") and (par_open or par == "none") and plan.tp == 1:
        allowed += zeropp_candidates(w.gpus_per_node, w.num_nodes)  # across nodes only
    if r.train.backend == "auto":  # both backends' candidates, each narrowed by its own section
        auto = True
        allowed += [c for c in auto_fsdp2_candidates(r) if c.label not in {a.label for a in allowed}]
    elif r.train.backend == "fsdp2":
        auto, allowed = False, [plan_candidate(plan)]
    elif not auto:
        allowed = [Candidate(int(stage), opt, par)]
    elif not allowed:
        raise RecipeError(
            r.problem(
                "zero.stage",
                f"no ZeRO candidate matches zero.stage={stage}, offload_optimizer={opt}, offload_params={par}",
            )
        )
    ctx = plan_context_for(plan, shape)
    preds = {c.label: predict_for(c, w, plan, ctx, gpu) for c in allowed}
    # auto: the fastest predicted first (the order of docs/design.md, Memory planning, breaks ties), so choose() takes
    # the fastest that fits
    allowed.sort(key=lambda c: ranking_time(preds[c.label]))
    choice = choose(with_zeropp(estimate_all(w, allowed), w), gpu, host, HEADROOM)
    selected = choice.chosen if auto else choice.estimates[0]
    tips = suggestions(w, gpu, host, HEADROOM, lora_params=None) if choice.chosen is None else []

    limit = gpu * (1 - HEADROOM)
    tight = selected is not None and selected.total_gb > TIGHT * limit
    host_tight = selected is not None and selected.host_ram_gb_per_node > TIGHT * host * (1 - HEADROOM)
    room = False
    if selected is not None and selected.candidate.stage in (1, 2):
        with_overlap = estimate(selected.candidate, replace(w, overlap_comm=True))
        room = with_overlap.total_gb <= limit
    if auto and choice.chosen is not None:
        rejected = "; ".join(f"{c.label}: {why}" for c, why in choice.rejected)
        reason = (
            f"{choice.chosen.candidate.label} is the fastest that fits ({choice.chosen.total_gb:.1f} GiB of "
            f"{limit:.1f} GiB per GPU)" + (f"; rejected {rejected}" if rejected else "")
        )
    elif auto:
        reason = "nothing fits"
    else:
        reason = f"fixed by the recipe ({selected.reason})" if selected else "fixed by the recipe"
    speed = speed_reason(choice, preds, ctx) if auto and choice.chosen is not None else ""
    if speed and choice.chosen is not None:  # a speed reason is only given for a chosen candidate
        rejected = "; ".join(f"{c.label}: {why}" for c, why in choice.rejected)
        reason = f"{speed}; memory {choice.chosen.total_gb:.1f} of {limit:.1f} GiB per GPU" + (
            f"; faster but rejected: {rejected}" if rejected else ""
        )
    return MemoryReport(
        shape=shape,
        workload=w,
        choice=choice,
        selected=selected,
        gpu_memory_gb=gpu,
        host_memory_gb=host,
        auto=auto,
        tight=tight,
        host_tight=host_tight,
        room_for_overlap=room,
        suggestions=tips,
        choice_reason=reason,
        recipe=r,
        predictions=preds,
        speed_reason=speed,
        activations=w.profile_for(selected.candidate if selected else allowed[0]).line(),
    )


def plan_context_for(plan: Plan, shape: ModelShape) -> PlanContext:
    return plan_context(plan, shape)


def predict_for(c: Candidate, w: Workload, plan: Plan, ctx: PlanContext, gpu_gb: float) -> Prediction:
    """Step time of candidate ``c`` with the knobs the plan would give it (the rules of ftkit.plan.knobs)."""
    oc = plan.recipe.zero.overlap_comm
    if oc == "auto":
        room = c.stage in (1, 2) and estimate(c, replace(w, overlap_comm=True)).total_gb <= gpu_gb * (1 - HEADROOM)
        oc, _ = overlap_comm_auto(c.stage, room)
    return predict(
        c,
        w,
        plan.grad_accum,
        ctx.net,
        ctx.gpu,
        overlap_comm=bool(oc),
        gpu_source=ctx.gpu_source,
        persistence_threshold=persistence_threshold(w.shape.hidden_size),
        lora_tensors=ctx.lora_tensors,
        calibration=ctx.calibration,
        cpu_adam=ctx.cpu_adam,
    )


def with_zeropp(estimates: list[Estimate], w: Workload) -> list[Estimate]:
    """ZeRO++ candidates cost hpZ's secondary partition on top of ZeRO-3's memory."""
    out = []
    for e in estimates:
        extra = zeropp_memory_bytes(e.candidate, w)
        if extra:  # resident for the whole step: every phase and the allocator's reserve grow with it
            comp = dict(e.components)
            tail: dict[str, int] = {k: comp.pop(k) for k in ("reserved", "context") if k in comp}
            comp["hpz_secondary"] = extra
            if tail.get("reserved"):
                tail["reserved"] += int(extra * (RESERVED_FACTOR - 1))
            comp.update(tail)
            phases = {k: v + extra for k, v in e.phases.items()}
            e = replace(e, components=comp, phases=phases)
        out.append(e)
    return out


def _margin(c: Candidate) -> float:
    """The margin a ZeRO++ candidate must win by (ZEROPP_MARGIN)."""
    return ZEROPP_MARGIN["quantized" if isinstance(c, ZeroPP) and (c.qwz or c.qgz) else "hpz"]


def speed_reason(choice: Choice, preds: dict[str, Prediction], ctx: PlanContext) -> str:
    """One line: why the chosen candidate, against the next fastest that fits (or the fastest that does not)."""
    chosen = choice.chosen
    if chosen is None:
        return ""
    p = preds[chosen.candidate.label]
    net = ctx.net
    link = f"{net.inter_gbs:g} GB/s inter-node link" if chosen and p.traffic.by_scope("inter") else "intra-node links"
    numbers = (
        f"{p.step_time_s:.3g} s/step, {p.tokens_per_s:,.0f} tokens/s, {p.inter_share:.0%} of the step waiting on "
        f"the {link}"
    )
    others = [e for e in choice.estimates if e.candidate != chosen.candidate]
    # A ZeRO++ candidate can be predicted faster and still lose: it must win by its margin (ZEROPP_MARGIN).
    held = [e for e in others if e.fits and preds[e.candidate.label].step_time_s < p.step_time_s]
    if held:
        f = min(held, key=lambda e: preds[e.candidate.label].step_time_s)
        q = preds[f.candidate.label]
        quantized = isinstance(f.candidate, ZeroPP) and (f.candidate.qwz or f.candidate.qgz)  # held: only ZeRO++
        why = " (its quantization changes the numerics)" if quantized else ""
        head = (
            f"{chosen.candidate.label} is chosen: {numbers}; {f.candidate.label} is predicted "
            f"{1 - q.step_time_s / p.step_time_s:.0%} faster ({q.step_time_s:.3g} s/step) but ZeRO++ must win by "
            f"{_margin(f.candidate):.0%} to be chosen{why}"
        )
    else:
        head = f"{chosen.candidate.label} is the fastest predicted that fits: {numbers}"
    if isinstance(chosen.candidate, ZeroPP):
        head += f" (ZeRO++ must win by {_margin(chosen.candidate):.0%})"
    fitting = [e for e in others if e.fits and not (held and e.candidate == f.candidate)]
    if fitting:
        o = fitting[0]
        q = preds[o.candidate.label]
        ratio = q.step_time_s / p.step_time_s
        return head + (
            f"; next, {o.candidate.label}: {q.step_time_s:.3g} s ({q.inter_share:.0%} waiting on communication), "
            + (
                f"{ratio:.2f}x slower"
                if ratio >= 1.005
                else "as fast within 1%"
                if ratio > 0.995
                else f"{1 - ratio:.0%} faster but held back by the ZeRO++ margin"
            )
        )
    faster = [e for e in others if preds[e.candidate.label].step_time_s < p.step_time_s]
    if faster:
        return head + f"; faster {faster[0].candidate.label} does not fit"
    return head


def auto_fsdp2_candidates(r: Recipe) -> list[Candidate]:
    """``train.backend: auto``: the FSDP2 candidates the ``fsdp`` section leaves open (a key the recipe sets is
    fixed; parameter offload only where there is device memory to save: cuda)."""
    f = r.fsdp
    reshard = [f.reshard_after_forward] if "fsdp.reshard_after_forward" in r.explicit else [False, True]
    offload = [f.offload_params] if "fsdp.offload_params" in r.explicit else [False, r.cluster.accelerator != "cpu"]
    out: dict[str, Candidate] = {}
    for o in dict.fromkeys(offload):
        for rs in reshard:
            c = fsdp2_candidate(rs, o)
            out.setdefault(c.label, c)
    return list(out.values())


def full_table(plan: Plan) -> MemoryReport:
    """Every candidate (not only those the recipe allows), each judged on its own, for ``ftkit plan``'s table
    (``train.backend: auto``: both backends')."""
    rep = plan.backend_report or plan.memory or plan_memory(plan)
    w = rep.workload
    cands: list[Candidate]
    fsdp2 = fsdp2_candidates(include_offload=plan.recipe.cluster.accelerator != "cpu")
    if plan.recipe.train.backend == "fsdp2" and plan.backend_report is None:
        cands = fsdp2
    else:
        cands = [*candidates(include_stage0=True), *zeropp_candidates(w.gpus_per_node, w.num_nodes)]
        cands += fsdp2 if plan.backend_report is not None else []
    judged = tuple(
        judge(e, rep.gpu_memory_gb, rep.host_memory_gb, HEADROOM) for e in with_zeropp(estimate_all(w, cands), w)
    )
    ctx = plan_context_for(plan, rep.shape)
    preds = {c.label: predict_for(c, w, plan, ctx, rep.gpu_memory_gb) for c in cands}
    anything = any(e.fits for e in judged)
    tips = (
        []
        if anything
        else suggestions(
            w,
            rep.gpu_memory_gb,
            rep.host_memory_gb,
            HEADROOM,
            lora_params=_default_lora(rep.shape) if w.lora_params is None else None,
        )
    )
    return replace(
        rep, choice=Choice(rep.choice.chosen, judged), suggestions=tips or rep.suggestions, predictions=preds
    )


def _default_lora(shape: ModelShape) -> int | None:
    try:
        return lora_trainable_params(shape, 16, ["q_proj", "k_proj", "v_proj", "o_proj"])
    except UserError:
        return None


def plan_context(plan: Plan, shape: ModelShape) -> PlanContext:
    """What the predictions for one plan share: the network, the GPU and the calibration its inputs gathered, the
    LoRA tensor sizes."""
    r = plan.recipe
    inputs = plan.inputs
    if inputs is not None and inputs.network is not None and inputs.gpu:
        gpu, gpu_src, net = inputs.gpu, inputs.gpu_source, inputs.network
    else:  # a plan built without its inputs (tests building a Plan by hand): the recipe's own
        gpu, gpu_src = resolve_gpu(r.cluster)
        net = resolve_network(r.cluster, [h for h, _ in plan.hosts])
    lora = None
    if r.peft is not None:
        try:
            lora = lora_tensors(shape, r.peft.r, r.peft.target_modules)
        except Exception:  # noqa: BLE001 - the memory planner reported a bad target already
            lora = None
    # priced as the plan renders it (plan.knobs.decide_optimizer): CPU Adam when asked for, or auto and the launch's
    # preflight found every host can load it; else torch's fused AdamW on the CPU
    cpu_adam = r.zero.cpu_adam is True or (r.zero.cpu_adam == "auto" and plan.cpu_adam_ok is True)
    cal = inputs.calibration if inputs is not None else None
    return PlanContext(gpu=gpu, gpu_source=gpu_src, net=net, lora_tensors=lora, calibration=cal, cpu_adam=cpu_adam)


def predict_plan(plan: Plan, candidate: Candidate | None = None) -> Prediction:
    """The prediction for the plan's own choice (or ``candidate``) with the plan's knobs."""
    if plan.memory is None:
        plan.memory = plan_memory(plan)
    ctx = plan_context(plan, plan.memory.shape)
    k = plan.knobs
    c = candidate or plan_candidate(plan)
    oc = k["overlap_comm"].value if "overlap_comm" in k else c.stage == 3
    return predict(
        c,
        plan.memory.workload,
        plan.grad_accum,
        ctx.net,
        ctx.gpu,
        overlap_comm=bool(oc),
        gpu_source=ctx.gpu_source,
        comm_bytes=PRECISION_BYTES[plan.recipe.train.precision],
        persistence_threshold=_knob_int(plan, "stage3_param_persistence_threshold", None),
        max_reuse_distance=_knob_int(plan, "stage3_max_reuse_distance", 10**9),
        lora_tensors=ctx.lora_tensors,
        reduce_bucket_size=_knob_int(plan, "reduce_bucket_size", None),
        calibration=ctx.calibration,
        cpu_adam=ctx.cpu_adam,
    )


def _knob_int(plan: Plan, name: str, default: _D) -> int | _D:
    """An integer knob's value; ``default`` when the plan has no such knob."""
    knob = plan.knobs.get(name)
    value = as_int(knob.value) if knob is not None else None
    return default if value is None else value


def plan_candidate(plan: Plan) -> Candidate:
    if plan.recipe.train.backend == "fsdp2":
        return fsdp2_candidate(plan.recipe.fsdp.reshard_after_forward, plan.recipe.fsdp.offload_params)
    k = plan.knobs
    hpz = _knob_int(plan, "zero_hpz_partition_size", 1)
    qwz = bool(k["zero_quantized_weights"].value) if "zero_quantized_weights" in k else False
    qgz = bool(k["zero_quantized_gradients"].value) if "zero_quantized_gradients" in k else False
    if plan.stage == 3 and (hpz > 1 or qwz or qgz):
        return ZeroPP(3, plan.offload_optimizer, plan.offload_params, hpz=hpz, qwz=qwz, qgz=qgz)
    return Candidate(plan.stage, plan.offload_optimizer, plan.offload_params)
