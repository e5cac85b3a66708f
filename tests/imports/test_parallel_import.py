"""Importing tensor and sequence parallelism (issue 40): Accelerate's parallelism_config, DeepSpeed's AutoTP and
Ulysses/ALST settings map to the recipe's parallel section, the batch counts data-parallel ranks, and the rendered
configs check clean against the sources (``ftkit check --against``)."""

from __future__ import annotations

import json

import pytest
import yaml

from ftkit.errors import UserError
from ftkit.imports import check_against
from ftkit.plan.load import load_and_plan
from ftkit.render.accelerate import accelerate_dict
from ftkit.render.deepspeed import render_deepspeed
from tests.imports.helpers import FIX, import_to


@pytest.fixture
def here(monkeypatch):
    monkeypatch.chdir(FIX)


def _recipe(out):
    return yaml.safe_load(out.read_text())


def test_llamafactory_autotp_maps_to_tp(here, tmp_path, model_dir):
    result, out = import_to(tmp_path, model_dir, "ds_z2_autotp.json")
    assert _recipe(out)["parallel"] == {"tp": 2, "sp": 1} and _recipe(out)["zero"]["stage"] == 2
    line = next(x for x in result.lines if "tensor_parallel.autotp_size" in x)
    assert "mapped -> parallel.tp = 2" in line
    plan = load_and_plan(str(out), [])
    assert (plan.tp, plan.dp_size) == (2, 4)
    assert render_deepspeed(plan)["tensor_parallel"] == {"autotp_size": 2}
    lines, count = check_against(plan, ["ds_z2_autotp.json"])
    assert count == 0, lines


def test_accelerate_alst_and_its_deepspeed_file_map_to_sp(here, tmp_path, model_dir):
    _, out = import_to(tmp_path, model_dir, "accelerate_alst.yaml")
    recipe = _recipe(out)
    assert recipe["parallel"] == {"tp": 1, "sp": 2} and recipe["zero"]["stage"] == 3
    assert recipe["cluster"]["gpus_per_node"] == 2
    plan = load_and_plan(str(out), [])
    assert (plan.sp, plan.dp_size) == (2, 1)
    acc = accelerate_dict(plan, "ds_alst.json")
    assert acc["parallelism_config"]["parallelism_config_sp_size"] == 2
    lines, count = check_against(plan, ["accelerate_alst.yaml", "ds_alst.json"])
    assert count == 0, lines


def test_accelerate_fsdp2_tensor_parallel(here, tmp_path, model_dir):
    _, out = import_to(tmp_path, model_dir, "accelerate_fsdp2_tp.yaml")
    recipe = _recipe(out)
    assert recipe["train"]["backend"] == "fsdp2" and recipe["parallel"] == {"tp": 2, "sp": 1}
    plan = load_and_plan(str(out), [])
    source = yaml.safe_load((FIX / "accelerate_fsdp2_tp.yaml").read_text())["parallelism_config"]
    assert accelerate_dict(plan, None)["parallelism_config"] == source  # the same four keys, the same sizes
    lines, count = check_against(plan, ["accelerate_fsdp2_tp.yaml"])
    assert count == 0, lines


def test_llamafactory_ulysses_block_maps_to_sp(here, tmp_path, model_dir):
    _, out = import_to(tmp_path, model_dir, "ds_z3_ulysses.json")
    assert _recipe(out)["parallel"]["sp"] == 4


def test_the_batch_counts_data_parallel_ranks(tmp_path, model_dir):
    src = tmp_path / "ds.json"
    src.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 2,
                "sequence_parallel_size": 2,
                "zero_optimization": {"stage": 2},
            }
        )
    )
    result, out = import_to(tmp_path, model_dir, str(src))
    recipe = _recipe(out)
    # 8 = micro 1 x accumulation 2 x data-parallel 4: the world is 4 x sp 2 = 8 ranks
    assert recipe["train"]["global_batch_size"] == 8 and recipe["cluster"]["gpus_per_node"] == 8
    assert any("tp x sp 2" in x for x in result.lines + result.report.notes)
    plan = load_and_plan(str(out), [])
    assert (plan.world_size, plan.dp_size, plan.grad_accum) == (8, 4, 2)


def test_context_parallelism_is_refused_in_one_line(here, tmp_path, model_dir):
    with pytest.raises(UserError) as e:
        import_to(tmp_path, model_dir, "accelerate_fsdp2_cp.yaml")
    lines = [str(p) for p in e.value.problems]
    assert any("parallelism_config_cp_size: context parallelism (ring attention) is not supported" in x for x in lines)
