"""Memory planning for a recipe: the Workload from the plan, every candidate's estimate, and the choice.

:mod:`ftkit.memory` is the arithmetic; this module ties it to a recipe: parameter counts from the model's
config.json (closed form, or the meta device for unknown families), LoRA trainable parameters from ``peft``,
the batch, sequence length and buckets from the plan. ``zero.stage: auto`` / ``zero.offload_optimizer: auto``
take the fastest candidate that fits ``cluster.gpu_memory_gb`` with :data:`HEADROOM` to spare (DESIGN §4 order);
fixed choices are estimated too, so ``ftkit plan`` can warn when they will not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .errors import RecipeError, UserError
from .memory import (
    Candidate,
    Choice,
    Estimate,
    Workload,
    candidates,
    choose,
    estimate,
    estimate_all,
    judge,
    suggestions,
)
from .params import ModelShape, count_params, count_params_meta, lora_trainable_params

HEADROOM = 0.10  # fraction of GPU memory and host RAM kept free
TIGHT = 0.80  # above this share of the (headroom-reduced) limit, memory counts as tight for buffer sizing


@dataclass
class MemoryReport:
    shape: ModelShape
    workload: Workload
    choice: Choice  # every candidate the recipe allows, judged, fastest first
    selected: Estimate | None  # the candidate the run will use (auto: the choice; fixed: the recipe's)
    gpu_memory_gb: float
    host_memory_gb: float
    auto: bool
    tight: bool
    host_tight: bool
    room_for_overlap: bool
    suggestions: list[str]
    choice_reason: str
    recipe: Any = None

    def choice_for(self, stage: Any, opt: Any, strict: bool = True) -> Candidate:
        if self.choice.chosen is None and not strict:
            return self.choice.estimates[-1].candidate
        if self.choice.chosen is None:
            raise RecipeError(
                self.recipe.problem(
                    "zero.stage",
                    f"auto: nothing fits in cluster.gpu_memory_gb={self.gpu_memory_gb:g} GiB per GPU with "
                    f"{HEADROOM:.0%} headroom; run `ftkit plan` for the table"
                    + ("; try: " + " | ".join(self.suggestions) if self.suggestions else ""),
                )
            )
        return self.choice.chosen.candidate

    def as_dict(self) -> dict[str, Any]:
        def est(e: Estimate) -> dict[str, Any]:
            return {
                "candidate": e.candidate.label,
                "stage": e.candidate.stage,
                "offload_optimizer": e.candidate.offload_optimizer,
                "offload_params": e.candidate.offload_params,
                "gpu_gib": round(e.total_gb, 3),
                "components_gib": {k: round(v / 2**30, 3) for k, v in e.components.items()},
                "host_ram_gib_per_node": round(e.host_ram_gb_per_node, 3),
                "fits": e.fits,
                "reason": e.reason,
            }

        s = self.shape
        return {
            "model": {
                "family": s.family,
                "total_params": s.total_params,
                "trainable_params": self.workload.phi,
                "hidden_size": s.hidden_size,
                "layers": s.num_layers,
                "heads": s.num_heads,
                "kv_heads": s.num_kv_heads,
                "vocab_size": s.vocab_size,
                "largest_layer_params": s.largest_layer_params,
                "count_source": s.source,
            },
            "limits": {
                "gpu_memory_gib": self.gpu_memory_gb,
                "host_memory_gib": self.host_memory_gb,
                "headroom": HEADROOM,
            },
            "candidates": [est(e) for e in self.choice.estimates],
            "selected": est(self.selected) if self.selected else None,
            "auto": self.auto,
            "reason": self.choice_reason,
            "suggestions": self.suggestions,
        }


def model_shape(plan: Any) -> ModelShape:
    """Closed form for known families; the meta device (imports transformers, ~seconds) for anything else."""
    path = plan.recipe["model.path"]
    shape = count_params(plan.model_config, source=plan.model_config_label or f"{path}/config.json")
    return shape if shape is not None else count_params_meta(plan.model_config_file or path)


def plan_memory(plan: Any) -> MemoryReport:
    r = plan.recipe
    shape = model_shape(plan)
    lora = None
    if r.has_peft:
        try:
            lora = lora_trainable_params(shape, r["peft.r"], r["peft.target_modules"])
        except UserError as e:
            raise RecipeError([r.problem("peft.target_modules", p.message) for p in e.problems]) from None
    w = Workload(
        shape=shape,
        world_size=plan.world_size,
        gpus_per_node=max(n for _, n in plan.hosts),
        micro_batch_size=plan.micro_batch_size,
        seq_len=r["data.max_seq_len"],
        precision=r["train.precision"],
        lora_params=lora,
        gradient_checkpointing=r["model.gradient_checkpointing"],
        reduce_bucket_size=None if r["zero.reduce_bucket_size"] == "auto" else r["zero.reduce_bucket_size"],
        pin_memory=r["cluster.accelerator"] != "cpu",
    )
    gpu, host = float(r["cluster.gpu_memory_gb"]), float(r["cluster.host_memory_gb"])
    stage, opt, par = r["zero.stage"], r["zero.offload_optimizer"], r["zero.offload_params"]
    auto = stage == "auto" or opt == "auto"
    # auto picks among the candidates the recipe leaves open: a fixed stage or offload stays fixed; parameter
    # offload is open only when the recipe did not set it; NVMe only when there is an nvme_path.
    par_open = stage == "auto" and "zero.offload_params" not in r.explicit
    allowed = [
        c
        for c in candidates(include_stage0=plan.world_size == 1, include_nvme=bool(r["zero.nvme_path"]))
        if (stage == "auto" or c.stage == stage)
        and (opt == "auto" or c.offload_optimizer == opt)
        and (par_open or c.offload_params == par)
    ]
    if not auto:
        allowed = [Candidate(stage, opt, par)]
    elif not allowed:
        raise RecipeError(
            r.problem(
                "zero.stage",
                f"no ZeRO candidate matches zero.stage={stage}, offload_optimizer={opt}, offload_params={par}",
            )
        )
    choice = choose(estimate_all(w, allowed), gpu, host, HEADROOM)
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
    )


def full_table(plan: Any) -> MemoryReport:
    """Every candidate (not only those the recipe allows), each judged on its own, for ``ftkit plan``'s table."""
    rep = plan.memory if plan.memory is not None else plan_memory(plan)
    w = rep.workload
    judged = tuple(
        judge(e, rep.gpu_memory_gb, rep.host_memory_gb, HEADROOM)
        for e in estimate_all(w, candidates(include_stage0=True))
    )
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
    return replace(rep, choice=Choice(rep.choice.chosen, judged), suggestions=tips or rep.suggestions)


def _default_lora(shape: ModelShape) -> int | None:
    try:
        return lora_trainable_params(shape, 16, ["q_proj", "k_proj", "v_proj", "o_proj"])
    except UserError:
        return None
