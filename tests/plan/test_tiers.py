"""The local checkpoint tier in the plan: where, how often, the host memory per node, or why it is off
(:mod:`ftkit.plan.local_tier`); the Young/Daly cadence."""

from __future__ import annotations

import math
from pathlib import Path

from ftkit.plan.local_tier import checkpoint_bytes_per_node, young_daly_steps
from tests.helpers.runs import ftkit
from tests.helpers.runs import write_recipe as _write_recipe


def tier_recipe(d: Path, fx: dict[str, Path], **overrides: object) -> Path:
    return _write_recipe(d, fx, checkpoint__local_dir="auto", checkpoint__local_steps=1, **overrides)


def test_young_daly_is_sqrt_2_c_m_in_steps_within_1_and_save_steps() -> None:
    steps, why = young_daly_steps(2.0, 24.0, 1.0, 100_000)
    assert steps == round(math.sqrt(2 * 2.0 * 24 * 3600))  # 588 s of 1 s steps
    assert "sqrt(2 x 2 s save x 24 h MTBF)" in why
    assert young_daly_steps(2.0, 24.0, 1.0, 50)[0] == 50  # never beyond train.save_steps
    assert young_daly_steps(0.001, 0.001, 100.0, 50)[0] == 1


def test_a_checkpoint_on_a_node_is_the_weights_the_module_states_and_the_nodes_share_of_adam() -> None:
    full = checkpoint_bytes_per_node(1_000_000, 1_000_000, 2, 2, world_size=16, per_node=8)
    assert full == 1_000_000 * 2 + 1_000_000 * 2 + 12 * 1_000_000 * 8 // 16 + (1 << 20)
    lora = checkpoint_bytes_per_node(1_000_000, 10_000, 2, 2, world_size=16, per_node=8)
    assert lora < full / 2


def test_the_plan_shows_the_tier_per_node_or_why_it_is_off(tmp_path: Path, model_dir: Path) -> None:
    fx = {"model": model_dir, "data": tmp_path / "data.jsonl"}
    fx["data"].write_text('{"text": "hello world"}\n')
    r = ftkit("plan", str(_write_recipe(tmp_path, fx)))
    assert r.returncode == 0, r.stderr
    assert "local checkpoint tier: off (checkpoint.local_dir: null" in r.stdout
    r = ftkit("plan", str(tier_recipe(tmp_path, fx)))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("local checkpoint tier:"))
    assert "/dev/shm/ftkit-" in line and "a save every 1 step(s)" in line and "GiB host memory per node" in line
    r = ftkit("plan", str(tier_recipe(tmp_path, fx)), "cluster.host_memory_gb=0.001", "zero.stage=2")
    assert "local checkpoint tier: off (auto: the tier needs" in r.stdout, r.stdout[-2000:]
