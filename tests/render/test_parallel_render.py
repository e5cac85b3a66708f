"""Rendering tensor and sequence parallelism (issue 40), checked with the consumers' own code: DeepSpeed's config
class (the world size the plan used), HF's ds_config consistency check, Accelerate's config loader and its launcher's
argument handling (what it exports to the ranks), Accelerate's ParallelismConfig; the batch arithmetic multiplies
the micro batch by the data-parallel degree everywhere."""

from __future__ import annotations

import json

import pytest
import yaml

from ftkit.plan.load import load_and_plan
from ftkit.render import ACCELERATE_FILE, DS_FILE, render_files
from ftkit.run.make_spec import training_arguments

# DeepSpeed's and Accelerate's own config checks, in-process (imported by the tests, not at collection: the quick
# tier's workers collect this module too and must not load the training stack)
pytestmark = pytest.mark.heavy


def _render(write_recipe, tmp_path, overrides):
    plan = load_and_plan(str(write_recipe()), overrides)
    files = render_files(plan, tmp_path / "configs")
    (tmp_path / "configs").mkdir(exist_ok=True)
    for name, text in files.items():
        (tmp_path / "configs" / name).write_text(text)
    return plan, files


def _deepspeed_config(cfg, world, monkeypatch):
    dsc = pytest.importorskip("deepspeed.runtime.config")

    monkeypatch.setattr(dsc.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(dsc.dist, "get_world_size", lambda *a, **k: world)
    return dsc.DeepSpeedConfig(cfg)


def _launch_env(path):
    """What ``accelerate launch --config_file path`` exports to the ranks for the parallelism config."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    return prepare_extend_env_parallelism_config(args, {})


SP = ["parallel.sp=2", "train.micro_batch_size=1", "train.global_batch_size=8", "data.max_seq_len=512"]


@pytest.mark.parametrize("stage", [2, 3])
def test_sequence_parallel_deepspeed(write_recipe, tmp_path, monkeypatch, stage):
    plan, files = _render(write_recipe, tmp_path, [*SP, f"zero.stage={stage}"])
    assert (plan.world_size, plan.dp_size, plan.grad_accum) == (8, 4, 2)  # 8 = 1 x 2 x dp 4
    cfg = json.loads(files[DS_FILE])
    assert cfg["sequence_parallel_size"] == 2 and "tensor_parallel" not in cfg
    assert "train_batch_size" not in cfg  # HF wants micro x GA x world, DeepSpeed micro x GA x dp: left to derive
    # zero.Init's config (no Ulysses mpu): DeepSpeed's data-parallel world is world / sp, the batch is the global one
    ds = _deepspeed_config(cfg, 8, monkeypatch)
    assert ds.world_size == 4 and ds.train_batch_size == 8 and ds.gradient_accumulation_steps == 2
    # HF Trainer's consistency check (its own world-size formula) finds nothing to refuse
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf = HfTrainerDeepSpeedConfig(json.loads(files[DS_FILE]))
    hf.fill_match("train_micro_batch_size_per_gpu", 1, "per_device_train_batch_size")
    hf.fill_match("gradient_accumulation_steps", 2, "gradient_accumulation_steps")
    hf.fill_match("train_batch_size", 8 * 1 * 2, "train_batch_size (calculated)")
    assert hf.mismatches == []
    acc = yaml.safe_load(files[ACCELERATE_FILE])
    assert acc["distributed_type"] == "DEEPSPEED"
    assert acc["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 4,
        "parallelism_config_dp_shard_size": 1,
        "parallelism_config_sp_size": 2,
        "parallelism_config_sp_backend": "deepspeed",
        "parallelism_config_sp_seq_length_is_variable": True,
        "parallelism_config_sp_attn_implementation": "sdpa",
    }
    env = _launch_env(tmp_path / "configs" / ACCELERATE_FILE)
    assert env["PARALLELISM_CONFIG_SP_SIZE"] == "2" and env["PARALLELISM_CONFIG_SP_BACKEND"] == "deepspeed"
    assert env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "4"
    from accelerate.parallelism_config import ParallelismConfig

    monkeypatch.setattr("os.environ", {**env})
    pc = ParallelismConfig()
    assert (pc.sp_size, pc.dp_replicate_size, pc.total_size) == (2, 4, 8)
    targs = training_arguments(plan, str(tmp_path / "run"), "ds.json")
    assert targs["gradient_accumulation_steps"] == 2 and targs["per_device_train_batch_size"] == 1


def test_tensor_parallel_deepspeed_autotp(write_recipe, tmp_path, monkeypatch):
    plan, files = _render(
        write_recipe,
        tmp_path,
        ["parallel.tp=2", "cluster.gpus_per_node=2", "train.global_batch_size=8", "zero.stage=1"],
    )
    assert (plan.tp, plan.dp_size, plan.grad_accum) == (2, 1, 4)
    cfg = json.loads(files[DS_FILE])
    assert cfg["tensor_parallel"] == {"autotp_size": 2} and "train_batch_size" not in cfg
    ds = _deepspeed_config(cfg, 2, monkeypatch)
    assert ds.tensor_parallel_config.autotp_size == 2 and ds.zero_optimization_stage == 1
    acc = yaml.safe_load(files[ACCELERATE_FILE])
    assert "parallelism_config" not in acc  # Accelerate reads AutoTP's size from ds_config.json


def test_tensor_parallel_fsdp2(write_recipe, tmp_path, monkeypatch):
    plan, files = _render(
        write_recipe,
        tmp_path,
        ["parallel.tp=2", "train.backend=fsdp2", "cluster.gpus_per_node=4", "train.global_batch_size=8"],
    )
    assert (plan.tp, plan.dp_size, plan.grad_accum) == (2, 2, 2)
    assert DS_FILE not in files
    acc = yaml.safe_load(files[ACCELERATE_FILE])
    assert acc["distributed_type"] == "FSDP" and acc["fsdp_config"]["fsdp_version"] == 2
    assert acc["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 1,
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2,
        "parallelism_config_cp_size": 1,
    }
    env = _launch_env(tmp_path / "configs" / ACCELERATE_FILE)
    assert env["PARALLELISM_CONFIG_TP_SIZE"] == "2" and env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2"
    from accelerate.parallelism_config import ParallelismConfig

    monkeypatch.setattr("os.environ", {**env})
    pc = ParallelismConfig()
    assert (pc.tp_size, pc.dp_shard_size, pc.total_size) == (2, 2, 4)


def test_flash_attention_reaches_ulysses(write_recipe, tmp_path, model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "_attn_implementation": "flash_attention_2"}))
    _, files = _render(write_recipe, tmp_path, SP)
    acc = yaml.safe_load(files[ACCELERATE_FILE])
    assert acc["parallelism_config"]["parallelism_config_sp_attn_implementation"] == "flash_attention_2"


def test_degrees_of_one_render_as_before(write_recipe, tmp_path):
    _, plain = _render(write_recipe, tmp_path, [])
    _, ones = _render(write_recipe, tmp_path, ["parallel.tp=1", "parallel.sp=1"])
    assert plain == ones
    assert "parallelism_config" not in plain[ACCELERATE_FILE] and "train_batch_size" in plain[DS_FILE]


def test_the_run_spec_carries_the_layout_for_the_ranks(write_recipe, tmp_path):
    from ftkit.run.make_spec import build_spec
    from ftkit.rundir.spec import RunSpec

    plan, _ = _render(write_recipe, tmp_path, SP)
    spec = build_spec(plan, tmp_path / "run", tmp_path / "configs" / DS_FILE)
    assert spec.parallel == {
        "tp": 1,
        "sp": 2,
        "dp": 4,
        "tp_engine": "",
        "sp_backend": "deepspeed",
        "sp_attn_implementation": "sdpa",
    }
    again = RunSpec.from_dict(json.loads(spec.to_json()))
    assert again.parallel == spec.parallel and plan.recipe.to_dict()["parallel"] == {"tp": 1, "sp": 2}
    plain, _ = _render(write_recipe, tmp_path, [])
    plain_spec = build_spec(plain, tmp_path / "run", tmp_path / "configs" / DS_FILE)
    assert plain_spec.parallel is None and "parallel" not in plain_spec.to_dict()
    assert "parallel" not in plain.recipe.to_dict()  # the recorded recipe (ftkit/recipe.json) and its hash as before
