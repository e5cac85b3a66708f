"""Imported configs train as their sources say (issue 38), on 2 CPU ranks:

- a DeepSpeed config with WarmupDecayLR (log-shaped warm-up from a floor, ``"auto"`` peak, warm-up and length HF
  fills from the command line's TrainingArguments) logs, step by step, the learning rate DeepSpeed's own
  ``WarmupDecayLR`` class computes for that config;
- an FSDP1 Accelerate config (what ``accelerate config`` writes on a CPU machine) trains under FSDP2: every rank's
  parameters are DTensors and the checkpoints are sharded DCP directories with every rank's shards committed.

Both are short (8 and 6 steps) and share the session's fixtures model and data.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ftkit.checkpoint.layout import read_commit
from ftkit.imports import import_configs
from tests.helpers.paths import FIXTURES
from tests.helpers.runs import (
    RUN_ENV,
    assert_no_process_left,
    committed_ok,
    free_port,
    ftkit,
    mp_lock,
    named,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FIX = FIXTURES / "import"
# test plumbing only (where to listen, no node-local tier, this machine's limits): the training comes from the import
PLUMBING = (
    "checkpoint.local_dir=null",
    "cluster.gpu_memory_gb=8",
    "cluster.host_memory_gb=16",
    "resilience.startup_timeout_s=240",
    "resilience.hang_timeout_s=60",
)


def _import_and_launch(tmp_path: Path, sources: list[str]) -> tuple[Path, Path]:
    """Import SOURCES into tmp_path/recipe.yaml (as ``ftkit import`` writes it), launch it; (recipe, run dir)."""
    out = tmp_path / "recipe.yaml"
    result = import_configs(sources, out=out, cwd=tmp_path)
    out.write_text(result.recipe_text)
    env = {**RUN_ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with mp_lock():
        t0 = time.monotonic()
        r = ftkit("launch", str(out), f"cluster.master_port={free_port()}", *PLUMBING, env=env, timeout=420)
        print(f"ftkit launch of the imported recipe: {time.monotonic() - t0:.1f} s")  # the run's wall time (-rP)
    run = tmp_path / "run"
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert_no_process_left(run)
    return out, run


def _metrics(run: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_an_imported_warmupdecaylr_config_logs_deepspeeds_learning_rate_at_every_step(fx, tmp_path):
    import torch
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    source = json.loads((FIX / "ds_warmupdecaylr_log.json").read_text())
    (tmp_path / "ds_config.json").write_text(json.dumps(source))
    (tmp_path / "train.sh").write_text(
        "#!/bin/bash\n"
        f"torchrun --nproc_per_node 2 train.py --deepspeed ds_config.json --model_name_or_path {fx['model']} "
        f"--train_file {fx['data']} --max_seq_length 128 --output_dir {tmp_path / 'run'} --use_cpu "
        "--per_device_train_batch_size 4 --gradient_accumulation_steps 2 --learning_rate 1e-3 --warmup_steps 3 "
        "--max_steps 8 --save_steps 4 --logging_steps 1 --seed 7\n"
    )
    recipe, run = _import_and_launch(tmp_path, [str(tmp_path / "train.sh")])
    rendered = json.loads((run / "ftkit" / "ds_config.json").read_text())["scheduler"]
    assert rendered["type"] == "WarmupDecayLR" and rendered["params"]["warmup_type"] == "log", rendered

    # DeepSpeed's class, built from the source config as HF fills its "auto"s: the peak from learning_rate, the
    # warm-up from warmup_steps, the length from the run's optimizer steps (max_steps)
    params = {**source["scheduler"]["params"], "warmup_max_lr": 1e-3, "warmup_num_steps": 3, "total_num_steps": 8}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = WarmupDecayLR(optimizer, **params)
    expected = {}
    for step in range(1, 9):
        schedule.step()  # DeepSpeed's engine steps its scheduler after each optimizer step; HF then logs it
        expected[step] = schedule.get_last_lr()[0]
    logged = {int(m["step"]): float(m["lr"]) for m in _metrics(run) if m.get("lr") is not None}  # type: ignore[arg-type]
    assert sorted(logged) == list(range(1, 9)), logged
    for step, lr in expected.items():
        assert logged[step] == pytest.approx(lr, rel=1e-6, abs=1e-12), (step, logged, expected)
    assert len({round(v, 12) for v in expected.values()}) >= 6  # a real schedule: warm-up, then decay


def test_an_imported_fsdp1_config_trains_under_fsdp2_with_sharded_checkpoints(fx, tmp_path):
    (tmp_path / "args.yaml").write_text(
        f"model_name_or_path: {fx['model']}\ntrain_file: {fx['data']}\nmax_seq_length: 128\n"
        f"output_dir: {tmp_path / 'run'}\nper_device_train_batch_size: 4\ngradient_accumulation_steps: 2\n"
        "learning_rate: 1.0e-3\nlr_scheduler_type: constant\nmax_steps: 6\nsave_steps: 3\nlogging_steps: 1\nseed: 7\n"
    )
    recipe, run = _import_and_launch(tmp_path, [str(FIX / "accelerate_fsdp1_cpu.yaml"), str(tmp_path / "args.yaml")])
    recipe_used = json.loads((run / "ftkit" / "recipe.json").read_text())
    assert (recipe_used["train"]["backend"], recipe_used["cluster"]["engine"]) == ("fsdp2", "accelerate")
    assert recipe_used["fsdp"]["state_dict_type"] == "sharded" and recipe_used["fsdp"]["reshard_after_forward"]
    assert not (run / "ftkit" / "ds_config.json").exists()
    # every rank proved FSDP2 is on: all of its parameters are DTensors
    beats = [json.loads(p.read_text()) for p in sorted((run / "ftkit" / "heartbeat").glob("rank-*.json"))]
    assert len(beats) == 2
    for beat in beats:
        sharding = beat.get("sharding") or {}
        assert sharding.get("params", 0) > 0 and sharding.get("dtensor_params") == sharding.get("params"), beat
    # sharded checkpoints: DCP directories with both ranks' shards, committed and verified
    for step in (3, 6):
        ckpt = run / f"checkpoint-{step}"
        record = read_commit(ckpt)
        assert record is not None and committed_ok(ckpt), ckpt
        files = set(record["files"])
        for d in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert {f"{d}/.metadata", f"{d}/__0_0.distcp", f"{d}/__1_0.distcp"} <= files, sorted(files)
    assert not named(run, "restart")
