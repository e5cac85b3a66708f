"""Rules across recipe keys that the schema's per-field types cannot state: which ZeRO stage/offload combinations
DeepSpeed can run. The loader reports them to the user; the planner's candidates obey them."""

from __future__ import annotations


def offload_problems(stage: int | str, offload_optimizer: str, offload_params: str) -> list[tuple[str, str]]:
    """The ZeRO stage/offload rules, stated once: ``(recipe key, problem)`` for each combination DeepSpeed cannot
    run. ``stage`` may be ``"auto"`` (the planner then only picks valid candidates). The recipe loader reports
    these to the user; :class:`Candidate` refuses them."""
    out = []
    if offload_params != "none" and stage not in (3, "auto"):
        out.append(
            (
                "zero.offload_params",
                f"parameter offload needs ZeRO stage 3 (zero.stage is {stage}); set zero.stage: 3 or "
                "offload_params: none",
            )
        )
    if offload_optimizer != "none" and stage == 0:
        out.append(("zero.offload_optimizer", "optimizer offload needs ZeRO stage 1 or higher (zero.stage is 0)"))
    if offload_optimizer == "nvme" and stage not in (3, "auto"):
        out.append(
            (
                "zero.offload_optimizer",
                f"nvme optimizer offload needs ZeRO stage 3 (zero.stage is {stage}); use cpu at stage 1/2",
            )
        )
    return out
