"""ftkit import (issue 26): existing DeepSpeed/Accelerate/TrainingArguments/Axolotl/LLaMA-Factory configs in, one
recipe out, every source key reported; ftkit check --against; the recipe fields that keep explicit values."""

from __future__ import annotations

import json

import pytest

from ftkit.configs import load_and_plan
from ftkit.render.deepspeed import render_deepspeed

# ---------------------------------------------------------------------------------------------------------------
# Recipe fields that keep a source's explicit values (default auto: ftkit's rule, byte-identical to before)


def test_explicit_zero_fields_are_rendered(write_recipe):
    p = write_recipe()
    cfg = render_deepspeed(
        load_and_plan(
            str(p),
            [
                "zero.stage=3",
                "zero.offload_optimizer=cpu",
                "zero.sub_group_size=0",
                "zero.prefetch_bucket_size=123",
                "zero.param_persistence_threshold=0",
                "zero.max_live_parameters=0",
                "zero.max_reuse_distance=5",
                "zero.contiguous_gradients=false",
                "zero.pin_memory=false",
            ],
        )
    )
    z = cfg["zero_optimization"]
    assert (z["sub_group_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (
        0,
        123,
        0,
    )
    assert (z["stage3_max_live_parameters"], z["stage3_max_reuse_distance"]) == (0, 5)
    assert z["contiguous_gradients"] is False and z["offload_optimizer"]["pin_memory"] is False


def test_explicit_stage2_fields_and_fp16_loss_scaling(write_recipe):
    p = write_recipe()
    plan = load_and_plan(
        str(p),
        [
            "zero.stage=2",
            "zero.round_robin_gradients=true",
            "train.precision=fp16",
            "train.fp16_initial_scale_power=32",
            "train.fp16_hysteresis=4",
        ],
    )
    cfg = render_deepspeed(plan)
    assert cfg["zero_optimization"]["round_robin_gradients"] is True
    assert cfg["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 32,
        "hysteresis": 4,
        "min_loss_scale": 1,
    }
    assert (
        "recipe.yaml" not in plan.knobs["fp16.hysteresis"].why
        and "fp16_hysteresis" in plan.knobs["fp16.hysteresis"].why
    )


def test_auto_fields_keep_the_rules(write_recipe):
    p = write_recipe()
    cfg = render_deepspeed(load_and_plan(str(p), ["zero.stage=3", "train.precision=fp16"]))
    z = cfg["zero_optimization"]
    assert (z["sub_group_size"], z["stage3_max_live_parameters"], z["stage3_prefetch_bucket_size"]) == (
        10**9,
        10**9,
        int(0.9 * 64 * 64),
    )
    assert json.dumps(cfg["fp16"]) == (
        '{"enabled": true, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, '
        '"hysteresis": 2, "min_loss_scale": 1}'
    )


@pytest.mark.parametrize("value", ["-1", "true", "1.5"])
def test_explicit_fields_are_validated(write_recipe, value):
    from ftkit.errors import RecipeError

    with pytest.raises(RecipeError) as e:
        load_and_plan(str(write_recipe()), [f"zero.sub_group_size={value}"])
    assert e.value.lines()[0].startswith("command line zero.sub_group_size:")
