"""The trackers people use, for real (no network): wandb offline and mlflow with a local store, fed by HF Trainer's own
integration callbacks, across a killed rank and a resume. One tracker run for the whole job (the same run resumed,
not one per attempt), each attempt recorded on it, and the steps the resumed attempt recomputed logged once.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.launch.trackers import wandb_records
from tests.helpers.paths import SCRIPTS
from tests.helpers.runs import assert_no_process_left, mp_lock, named, write_recipe

pytestmark = pytest.mark.slow
STEPS, SAVE = 4, 2


def _items(items) -> dict:
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}


def _launch(tmp_path: Path, fx, command: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    recipe = write_recipe(
        tmp_path,
        fx,
        train__max_steps=STEPS,
        train__save_steps=SAVE,
        train__report_to=["wandb", "mlflow"],
        resilience__resume_tolerance=0.0,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "FTKIT_FAULT"))}
    env.update(
        {
            "DS_ACCELERATOR": "cpu",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "FTKIT_FAULT_INJECT": f"kill_logged:1:{STEPS}",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_DIR": str(tmp_path),
            "MLFLOW_TRACKING_URI": f"file://{tmp_path / 'mlruns'}",
            "MLFLOW_ALLOW_FILE_STORE": "true",
        }
    )
    with mp_lock():
        r = subprocess.run(
            [sys.executable, "-m", "ftkit", "launch", str(recipe), *command],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=tmp_path,
        )
    return r, tmp_path / "run"


def _check(r: subprocess.CompletedProcess, run: Path, tmp_path: Path) -> None:
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert len(named(run, "restart")) == 1
    ids = json.loads((run / "ftkit" / "trackers.json").read_text())

    # wandb: one offline directory per attempt, all of the same run; each step's loss once across them.
    dirs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(dirs) == 2, dirs
    run_ids, steps, summaries = set(), [], {}
    for d in dirs:
        for rec in wandb_records(Path(glob.glob(f"{d}/run-*.wandb")[0])):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(rec.run.run_id)
            elif kind == "history":
                row = _items(rec.history.item)
                if "train/loss" in row:
                    steps.append(row["train/global_step"])
            elif kind == "summary":
                summaries.update(_items(rec.summary.update))
    assert run_ids == {ids["wandb_run_id"]}, run_ids
    assert sorted(steps) == list(range(1, STEPS + 1)), steps  # the recomputed steps 3 and 4: logged once
    assert summaries.get("ftkit/attempt") == 1 and "resumed at step 2" in summaries.get("ftkit/last_start", "")

    # mlflow: one run, resumed by id; each step's loss once; every attempt tagged on it.
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # mlflow 3 keeps its file store for those who ask
    client = MlflowClient(tracking_uri=f"file://{tmp_path / 'mlruns'}")
    runs = [x for e in client.search_experiments() for x in client.search_runs([e.experiment_id])]
    assert [x.info.run_id for x in runs] == [ids["mlflow_run_id"]], runs
    history = client.get_metric_history(ids["mlflow_run_id"], "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), [(m.step, m.value) for m in history]
    tags = runs[0].data.tags
    assert tags["ftkit.supervise.attempt.0"] == "attempt 0: fresh start", tags
    assert tags["ftkit.supervise.attempt.1"].startswith("attempt 1: resumed at step 2 (attempt 0 failed"), tags
    assert_no_process_left(run)


@pytest.mark.timeout(900)
def test_wandb_and_mlflow_keep_one_run_across_a_restart_with_the_builtin_entry(fx, tmp_path):
    r, run = _launch(tmp_path, fx, [])
    _check(r, run, tmp_path)


@pytest.mark.extended  # CI: the built-in entry's restart
@pytest.mark.timeout(900)
def test_wandb_and_mlflow_keep_one_run_across_a_restart_with_a_wrapped_script(fx, tmp_path):
    script = SCRIPTS / "hf_trainer.py"
    command = ["--", "python", str(script), "--model", str(fx["model"]), "--data", str(fx["data"])]
    r, run = _launch(tmp_path, fx, command)
    _check(r, run, tmp_path)
