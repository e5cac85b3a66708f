"""The step-time model without communication (ftkit.plan.speed): its parts, the offloaded optimizer per
implementation, and the calibration fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftkit.model.shape import count_params
from ftkit.plan.comm import NETWORK_PRESETS, predict
from ftkit.plan.memory import Candidate, Fsdp2, Workload
from ftkit.plan.profile import from_trace
from ftkit.plan.speed import CalPoint, expected_error_line, fit

TRACES = json.loads((Path(__file__).parent / "data" / "trace-llama-0.27b.json").read_text())
SHAPE = count_params(TRACES["config"])
PROFILE = from_trace(TRACES["full"]["answer"], 16, "recorded")
W = Workload(SHAPE, micro_batch_size=8, seq_len=1024, precision="bf16", profile=PROFILE)
NET = NETWORK_PRESETS["nvlink-ib400"]


def _predict(c: Candidate, **kw: object):  # noqa: ANN202
    return predict(c, W, 1, NET, "h200", overlap_comm=False, **kw)  # type: ignore[arg-type]


def test_small_models_are_bound_by_hooks_not_flops() -> None:
    """The 0.27B model's GEMMs take ~20 ms of a 0.2-0.5 s step: the engines' hooks make the difference, ZeRO-3's
    (a fetch per module, a heavier gradient hook) most."""
    z2, z3, fsdp = _predict(Candidate(2)), _predict(Candidate(3)), _predict(Fsdp2(3))
    assert z2.assumptions["parts_s"]["gemm_s"] < 0.1 * z2.step_time_s
    assert fsdp.step_time_s < z2.step_time_s < z3.step_time_s
    assert z3.overhead_s > 2 * z2.overhead_s - z2.assumptions["parts_s"]["step_fixed_s"]


def test_the_offloaded_step_is_priced_per_optimizer_implementation() -> None:
    """DeepSpeed's CPU Adam ran 1.1-1.2x faster than torch's fused AdamW on the CPU, what ftkit renders without it
    (benchmarks/cpu_adam.py)."""
    ds = _predict(Candidate(2, "cpu"), cpu_adam=True)
    torch_adam = _predict(Candidate(2, "cpu"), cpu_adam=False)
    ds_s, torch_s = ds.assumptions["parts_s"]["offload_s"], torch_adam.assumptions["parts_s"]["offload_s"]
    assert 0 < ds_s < torch_s < 1.2 * ds_s
    assert _predict(Candidate(2)).host_s == 0


def test_one_run_calibrates_the_host_two_runs_both_parts() -> None:
    one = CalPoint("a", "ZeRO-2", measured_s=0.30, gpu_s=0.05, host_s=0.15, other_s=0.05)
    cal = fit("h200", [one], "a")
    assert cal.gpu_scale == 1.0 and cal.host_scale == pytest.approx(20 / 15)
    assert cal.points[0].predicted(cal.gpu_scale, cal.host_scale) == pytest.approx(0.30)
    # two runs whose GPU and host parts differ: both scales are found
    a = CalPoint("a", "x", measured_s=2 * 0.1 + 3 * 0.2, gpu_s=0.1, host_s=0.2, other_s=0.0)
    b = CalPoint("b", "y", measured_s=2 * 0.4 + 3 * 0.1, gpu_s=0.4, host_s=0.1, other_s=0.0)
    cal = fit("h200", [a, b], "a, b")
    assert (cal.gpu_scale, cal.host_scale) == pytest.approx((2.0, 3.0))
    assert "expected error ±25%" in expected_error_line(cal, "h200")  # two runs: the single-run error stands in
    assert expected_error_line(None, "h200") == "step times uncalibrated (defaults for H200 SXM; docs/accuracy.md)"


def test_a_calibration_of_another_gpu_class_is_not_used() -> None:
    cal = fit("a100", [CalPoint("a", "x", measured_s=1.0, gpu_s=0.1, host_s=0.1, other_s=0.0)], "a")
    assert _predict(Candidate(2), calibration=cal).step_time_s == _predict(Candidate(2)).step_time_s
    assert _predict(Candidate(2), calibration=cal).assumptions["calibration"] == "uncalibrated"
