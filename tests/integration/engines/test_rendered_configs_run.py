"""The files `ftkit render` writes (the ones a repository checks in) run as they are: HF Trainer with the rendered
ds_config.json under `accelerate launch --config_file accelerate.yaml` and under the `deepspeed` launcher, 2 CPU
processes, stage 2 and 3, passing HF Trainer's own DeepSpeed-config consistency check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.plan.load import load_and_plan
from ftkit.run.prepare import prepare_run
from ftkit.rundir.layout import RunDir
from tests.helpers.runs import free_port, ftkit, losses, mp_lock, write_recipe


@pytest.fixture(scope="module")
def fixtures(fx):
    return fx  # conftest's, made once per session


def _prepare(tmp_path: Path, fixtures, stage: int) -> tuple[Path, RunDir]:
    recipe = write_recipe(tmp_path, fixtures, zero__stage=stage, train__max_steps=4, train__save_steps=2)
    out = ftkit("render", str(recipe), "-o", str(tmp_path / "configs"))
    assert out.returncode == 0, out.stderr
    rd = prepare_run(load_and_plan(str(recipe), []))
    spec = rd.read_spec()
    # Train with the checked-in copy, not the run directory's: that is the file under test.
    spec["training_args"]["deepspeed"] = str(tmp_path / "configs" / "ds_config.json")
    rd.spec.write_text(json.dumps(spec))
    return recipe, rd


def _env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _check(out: subprocess.CompletedProcess, rd: RunDir) -> None:
    logs = "".join(p.read_text() for p in sorted(rd.path.glob("logs/attempt-0/rank-*.log")))
    # HF Trainer raises on any DeepSpeed/TrainingArguments mismatch, so exit 0 means its check passed.
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:] + logs[-3000:]
    assert "Please correct the following DeepSpeed config values" not in logs
    assert (rd.final / "ftkit_commit.json").exists()
    assert sorted(losses(rd.path)) == [1, 2, 3, 4]


def _launch(launcher: list[str], recipe: Path, rd: RunDir) -> None:
    """Start the training entry under ``launcher`` from the recipe's directory (where the rendered paths point)."""
    with mp_lock():
        out = subprocess.run(
            [sys.executable, "-m", *launcher, "ftkit.launch.train", str(rd.path)],
            cwd=recipe.parent,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=540,
        )
    _check(out, rd)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_launch_with_rendered_yaml(tmp_path, fixtures, stage):
    recipe, rd = _prepare(tmp_path, fixtures, stage)
    launcher = [
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate.yaml",
        "--main_process_port",
        str(free_port()),
        "-m",
    ]
    _launch(launcher, recipe, rd)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_launcher_with_rendered_json(tmp_path, fixtures, stage):
    recipe, rd = _prepare(tmp_path, fixtures, stage)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    launcher = [
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile),
        "--no_ssh_check",
        "--master_addr",
        "127.0.0.1",  # without it DeepSpeed asks `ssh localhost hostname -I` for one
        "--master_port",
        str(free_port()),
        "--no_local_rank",
        "--module",
    ]
    _launch(launcher, recipe, rd)
