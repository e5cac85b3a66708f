"""The FSDP2 half of a plan (``train.backend: fsdp2``): every field of accelerate.yaml's ``fsdp_config`` with its
value and why (``ftkit explain`` lists them, the renderer writes them), and the ZeRO stage and offloads whose memory
the ``fsdp`` section's candidate has (:class:`ftkit.plan.memory.Fsdp2`; the planner estimates it like any other)."""

from __future__ import annotations

from collections.abc import Callable

from ftkit.model.shape import decoder_layer_class
from ftkit.plan.memory import fsdp2_candidate
from ftkit.plan.types import Plan
from ftkit.recipe.load import Recipe

MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}  # train.precision -> Accelerate's mixed_precision
FSDP_CONFIG_KEYS = (  # in the order Accelerate writes them
    "fsdp_activation_checkpointing",
    "fsdp_auto_wrap_policy",
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_offload_params",
    "fsdp_reshard_after_forward",
    "fsdp_state_dict_type",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_version",
)


def resolve_fsdp(plan: Plan, src: Callable[[Recipe, str], str]) -> None:
    """Note every FSDP knob, and the ZeRO stage and offloads whose memory the FSDP2 candidate has (the planner's
    tables and the local tier read ``plan.stage``)."""
    r = plan.recipe
    f = r.fsdp
    c = fsdp2_candidate(f.reshard_after_forward, f.offload_params)
    plan.stage, plan.offload_optimizer, plan.offload_params = c.stage, c.offload_optimizer, c.offload_params
    plan.note("fsdp_version", 2, "train.backend fsdp2 (" + src(r, "train.backend") + ")")
    plan.note(
        "fsdp_activation_checkpointing",
        bool(r.model.gradient_checkpointing),
        "model.gradient_checkpointing (FSDP checkpoints activations per wrapped layer)",
    )
    plan.note("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "one FSDP unit per decoder layer")
    plan.note("fsdp_cpu_ram_efficient_loading", f.cpu_ram_efficient_loading, src(r, "fsdp.cpu_ram_efficient_loading"))
    plan.note("fsdp_offload_params", f.offload_params, src(r, "fsdp.offload_params"))
    plan.note("fsdp_reshard_after_forward", f.reshard_after_forward, src(r, "fsdp.reshard_after_forward"))
    plan.note(
        "fsdp_state_dict_type",
        "SHARDED_STATE_DICT" if f.state_dict_type == "sharded" else "FULL_STATE_DICT",
        f"fsdp.state_dict_type {f.state_dict_type} ({src(r, 'fsdp.state_dict_type')})",
    )
    if f.transformer_layer_cls != "auto":
        plan.note("fsdp_transformer_layer_cls_to_wrap", f.transformer_layer_cls, src(r, "fsdp.transformer_layer_cls"))
    else:
        layer = decoder_layer_class(plan.model_config)
        archs = plan.model_config.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else "none"
        why = (
            f"auto: config.json's architectures ({arch})"
            if layer
            else f"auto: config.json's architectures ({arch}) name no known layer class: Accelerate wraps the "
            "model's _no_split_modules"
        )
        plan.note("fsdp_transformer_layer_cls_to_wrap", layer, why)
    plan.note("mixed_precision", MIXED_PRECISION[r.train.precision], f"train.precision {r.train.precision}")
    plan.note("gradient_clipping", r.train.max_grad_norm, "train.max_grad_norm (TrainingArguments.max_grad_norm)")


def fsdp_config(plan: Plan) -> dict[str, object]:
    """accelerate.yaml's ``fsdp_config`` from the plan's knobs (a layer class of None is left out)."""
    out: dict[str, object] = {k: plan.knobs[k].value for k in FSDP_CONFIG_KEYS}
    if out["fsdp_transformer_layer_cls_to_wrap"] is None:
        del out["fsdp_transformer_layer_cls_to_wrap"]
    return out
