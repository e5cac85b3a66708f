"""Issue 35, point 5: ``make gpu-check`` (benchmarks/gpu_check.py) off a GPU, and how it reads a run and writes
its table. The runs themselves need a GPU (or ``--rehearse`` on CPU ranks: minutes, not in this suite)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
assert spec is not None and spec.loader is not None
gc = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gc
spec.loader.exec_module(gc)


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "accuracy.md"
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin"},  # no nvidia-smi here either way
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("gpu-check: no CUDA GPU here"), r.stdout
    assert not out.exists()
    make = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True)
    assert "benchmarks/gpu_check.py" in make.stdout, make.stdout + make.stderr


def _m(step: int, t: float, attempt: int = 0, **kw: object) -> dict[str, object]:
    return {"step": step, "loss": 10.0 - step * 0.1, "attempt": attempt, "time": t, **kw}


def test_step_time_is_the_median_without_the_steps_that_saved():
    # steps 1-10 of attempt 0 every 0.2 s, step 8 saved (1.7 s), then attempt 1 recomputes 9-12 at 0.25 s
    metrics = [_m(s, 0.2 * s + (1.5 if s >= 8 else 0.0)) for s in range(1, 11)]
    metrics += [_m(s, 100 + 0.25 * s, attempt=1) for s in range(9, 13)]
    metrics.append({"step": 8, "event": "commit", "attempt": 0, "time": 2.0})
    got = gc.step_time(metrics, save_every=8)
    assert got == pytest.approx(0.2)  # 7 deltas of 0.2 (first step and step 8 left out), 3 of 0.25
    assert gc.step_time([], 8) is None


def test_memory_resume_tier_and_recomputed_loss():
    gib = 1 << 30
    metrics = [_m(1, 1.0, mem_peak=12 * gib, mem_reserved_peak=13 * gib), _m(2, 2.0, mem_peak=int(12.35 * gib))]
    metrics += [_m(9, 5.0), _m(10, 6.0), _m(9, 9.0, attempt=1), {**_m(10, 10.0, attempt=1), "loss": 9.0 + 1e-3}]
    assert gc.memory_peaks(metrics) == (pytest.approx(12.35), pytest.approx(13.0))
    assert gc.recomputed(metrics) == {"step": 10, "loss_diff": pytest.approx(1e-3)}
    events = [
        {"event": "checkpoint_chosen", "attempt": 0, "tier": None},
        {"event": "failure", "attempt": 0},
        {"event": "checkpoint_chosen", "attempt": 1, "tier": "local"},
    ]
    assert gc.resume_tier(events) == "local" and gc.resume_tier(events[:2]) is None
    assert gc.parse_smi_mib("15534\n") == 15534 and gc.parse_smi_mib("N/A") is None


def test_predicted_reads_the_chosen_candidate_of_ftkit_plan_json(write_recipe):
    p = write_recipe()
    out = subprocess.run([sys.executable, "-m", "ftkit", "plan", str(p), "--json"], capture_output=True, text=True)
    plan = json.loads(out.stdout)
    got = gc.predicted(plan, gc.CASES[2])
    assert got["device_gib"] is not None and got["device_gib"] > 0 and got["step_s"] is not None and got["step_s"] > 0


def test_the_table_is_appended_with_date_gpu_versions_and_errors(tmp_path):
    r = gc.Result(
        "zero2",
        exit_code=0,
        predicted={"device_gib": 16.0, "allocator_gib": 12.0, "step_s": 0.2},
        measured={"device_gib": 15.17, "allocator_gib": 12.35, "reserved_gib": 13.5, "step_s": 0.211},
        resume_tier="local",
        recomputed={"step": 9, "loss_diff": 0.0},
        ok=True,
    )
    bad = gc.Result("no-toolkit-cpu-adam", exit_code=1, ok=False, note="ftkit: error: ...")
    machine = {"date": "2026-11-28", "gpu": "NVIDIA H200, 143771 MiB, 580.159.04", "torch": "2.11.0+cu130",
               "commit": "abc1234"}  # fmt: skip
    out = tmp_path / "docs" / "accuracy.md"
    out.parent.mkdir()
    gc.append_table(out, gc.table([r, bad], machine))
    gc.append_table(out, gc.table([r], {**machine, "date": "2026-11-29"}))
    text = out.read_text()
    assert text.startswith("# ftkit's numbers against real hardware\n\n## make gpu-check, 2026-11-28: NVIDIA H200")
    assert text.count("## make gpu-check, ") == 2 and "torch 2.11.0+cu130" in text and "(abc1234)" in text
    row = next(line for line in text.splitlines() if line.startswith("| zero2 |"))
    assert "16.00 / 15.17 (+5%)" in row and "0.200 / 0.211 (-5%)" in row and "| local |" in row and "| yes |" in row
    assert "| NO: ftkit: error: ... |" in text
