"""Issue 10, deliverable 5 with real processes: a resume checks what changed (2 CPU ranks, the tiny model).

A run trains to step 4 and commits checkpoint-4 (its commit record carries the fingerprint). Relaunching it with
another learning rate is refused (exit 2, naming the key); with ``--allow-changes train.learning_rate`` the resumed
Trainer really uses the new rate: the lr logged in metrics.jsonl after the resume is the new peak times the cosine
schedule at that step, not the checkpoint's. Changed data (same size, other bytes) is refused naming the file.

``test_rank_applies_allowed_change`` drives the rank side alone (the ranks started directly with torchrun, the
spec's ``resume_overrides`` filled as the supervisor fills them), so it does not depend on the launch wiring.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.checkpoint.layout import read_commit
from ftkit.run.fingerprint import compare
from ftkit.rundir.layout import RunDir
from tests.helpers.runs import assert_no_process_left, events, free_port, ftkit, mp_lock
from tests.helpers.runs import write_recipe as _write_recipe  # conftest has a fixture of the same name

pytestmark = pytest.mark.slow

ENV = {"DS_ACCELERATOR": "cpu"}
OLD_LR, NEW_LR = 1e-3, 5e-4
WARMUP = 2
RUN_S = 300


def cosine(step: int, total: int, warmup: int = WARMUP) -> float:
    """HF's get_cosine_schedule_with_warmup multiplier (num_cycles 0.5)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def recipe(directory: Path, fx: dict[str, Path], data: Path | None = None) -> Path:
    return _write_recipe(
        directory,
        {**fx, "data": data or fx["data"]},
        train__max_steps=4,
        train__save_steps=4,
        train__learning_rate=OLD_LR,
        train__lr_scheduler="cosine",
        train__warmup_steps=WARMUP,
    )


def logged_lr(run_dir: Path, attempt: int | None = None) -> dict[int, float]:
    out = {}
    for line in RunDir(run_dir).metrics.read_text().splitlines():
        m = json.loads(line)
        if "loss" in m and (attempt is None or m.get("attempt") == attempt):
            out[int(m["step"])] = float(m["lr"])
    return out


def first_run(tmp_path: Path, fx: dict[str, Path], data: Path | None = None) -> tuple[Path, Path]:
    rec = recipe(tmp_path, fx, data)
    run = tmp_path / "run"
    r = ftkit("launch", str(rec), env=ENV, timeout=RUN_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The schedule formula is HF's: the first run logs old peak x cosine(step, 4 steps).
    lrs = logged_lr(run, 0)
    assert sorted(lrs) == [1, 2, 3, 4]
    for step, lr in lrs.items():
        assert lr == pytest.approx(OLD_LR * cosine(step, 4), rel=1e-6, abs=1e-12), (step, lr)
    # Every commit record carries the run's fingerprint.
    spec = RunDir(run).read_spec()
    for d in (run / "checkpoint-4", run / "final"):
        assert read_commit(d)["extra"]["fingerprint"] == spec["fingerprint"], d
    return rec, run


@pytest.mark.extended  # CI: the same through ftkit launch, below
def test_rank_applies_allowed_change(tmp_path: Path, fx: dict[str, Path]):
    """The supervisor's part done by hand: new spec with resume_overrides, ranks resumed from checkpoint-4."""
    from ftkit.plan.plan import build_plan
    from ftkit.recipe.load import load_recipe
    from ftkit.run.prepare import prepare_run

    with mp_lock():
        rec, run = first_run(tmp_path, fx)
        recorded = read_commit(run / "checkpoint-4")["extra"]["fingerprint"]
        plan = build_plan(load_recipe(rec, [f"train.learning_rate={NEW_LR}", "train.max_steps=8"]), with_memory=False)
        rd = prepare_run(plan)  # ds_config.json and TrainingArguments say the new lr ...
        spec = rd.read_spec()
        check = compare(recorded, spec["fingerprint"], ["train.learning_rate"])
        assert check.ok and check.overrides() == {"train.learning_rate": NEW_LR}
        spec["resume_overrides"] = check.overrides()  # ... and the rank re-applies it after loading the checkpoint
        rd.spec.write_text(json.dumps(spec, indent=2))
        env = {**os.environ, **ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "-m",
            "ftkit.launch.train",
            str(run),
            "--attempt",
            "1",
            "--resume",
            str(run / "checkpoint-4"),
        ]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=RUN_S, start_new_session=True)
        log = RunDir(run).rank_log(1, 0).read_text()
        assert proc.returncode == 0, proc.stderr[-3000:] + log[-3000:]
        assert "ftkit: resume override train.learning_rate: peak 0.001 -> 0.0005" in log
        lrs = logged_lr(run, 1)
        assert sorted(lrs) == [5, 6, 7, 8]
        for step, lr in lrs.items():  # the new peak on the 8-step schedule, not the checkpoint's 0.001
            assert lr == pytest.approx(NEW_LR * cosine(step, 8), rel=1e-6), (step, lr)
        assert_no_process_left(run)


def test_relaunch_refuses_changes_and_applies_allowed_ones(tmp_path: Path, fx: dict[str, Path]):
    """The acceptance through `ftkit launch` (needs the launch wiring: fingerprint check and --allow-changes)."""
    data = tmp_path / "data.jsonl"
    data.write_bytes(fx["data"].read_bytes())
    with mp_lock():
        rec, run = first_run(tmp_path, fx, data)
        spec_before = RunDir(run).spec.read_bytes()

        r = ftkit("launch", str(rec), f"train.learning_rate={NEW_LR}", "train.max_steps=8", env=ENV, timeout=RUN_S)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "train.learning_rate" in r.stderr and "--allow-changes" in r.stderr
        assert "Traceback" not in r.stderr
        assert RunDir(run).spec.read_bytes() == spec_before  # nothing written before the resume decision

        r = ftkit(
            "launch",
            str(rec),
            f"train.learning_rate={NEW_LR}",
            "train.max_steps=8",
            "--allow-changes",
            "train.learning_rate",
            env=ENV,
            timeout=RUN_S,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "train.learning_rate" in r.stdout + r.stderr  # the applied changes are listed
        after = {s: lr for s, lr in logged_lr(run).items() if s > 4}
        assert sorted(after) == [5, 6, 7, 8]
        for step, lr in after.items():
            assert lr == pytest.approx(NEW_LR * cosine(step, 8), rel=1e-6), (step, lr)
        assert any("train.learning_rate" in json.dumps(e) for e in events(run))

        raw = bytearray(data.read_bytes())
        i = raw.index(b"a") if b"a" in raw else len(raw) // 2
        raw[i : i + 1] = b"b"  # same size, other bytes
        data.write_bytes(bytes(raw))
        r = ftkit("launch", str(rec), f"train.learning_rate={NEW_LR}", "train.max_steps=12", env=ENV, timeout=RUN_S)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "data.train" in r.stderr and str(data) in r.stderr and "Traceback" not in r.stderr
        assert_no_process_left(run)
