"""Derive the step-time model's default host coefficients from measured runs, and print predicted vs measured.

The GPU side of ``ftkit.plan.speed`` comes from data sheets (peak FLOP/s, HBM bandwidth) and the model's traced
GEMMs; the host side (per kernel launch, per engine hook, per optimizer step, the CPU optimizer's rate) depends on
the host CPU and the libraries, so it is measured:

* ``--h200`` (default): tests/plan/data/h200-2026-11-27.json (five cases on one H200). With the launch cost (12 us), the
  per-step cost (40 ms) and ZeRO-3's per-module hook (20 us) fixed, the five step times determine five coefficients
  exactly: DeepSpeed ZeRO-1/2's per-tensor gradient hook (from ZeRO-2), FSDP2's per-unit cost (FSDP2), ZeRO-3's
  per-tensor gradient hook and per-module fetch (ZeRO-3 and LoRA ZeRO-3 together), and CPU Adam's rate (ZeRO-2 +
  offload). So the defaults reproduce these five cases by construction: the evidence that the model *predicts* is
  the calibration tests (tests/plan/test_accuracy.py, other GPU classes, tests/integration/plan/test_calibrate.py
  across micro batches on CPU ranks), not this table.
* ``--cpu RUN_DIR...``: measured 2-rank CPU runs (``ftkit launch`` run directories): the CPU class's per-launch and
  per-step costs, fitted by least squares on the runs' step times.

    .venv/bin/python benchmarks/fit_step_model.py [--h200] [--cpu RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ftkit.plan import speed  # noqa: E402


def _h200() -> None:
    import pytest

    from tests.plan import test_accuracy as acc

    tmp = Path(tempfile.mkdtemp())
    mp = pytest.MonkeyPatch()
    recipe = (
        acc.h200.__wrapped__(tmp, mp) if hasattr(acc.h200, "__wrapped__") else acc.h200._get_wrapped_function()(tmp, mp)
    )
    base = speed.CLASSES["h200"]

    def step(case: str, **coef: float) -> float:
        speed.CLASSES["h200"] = dataclasses.replace(base, **coef)
        try:
            return float(acc.plan_json(recipe, *acc._overrides(acc.CASES[case]))["selected"]["step_time_s"])
        finally:
            speed.CLASSES["h200"] = base

    zero = dict(grad_hook_us=0.0, z3_grad_hook_us=0.0, z3_fetch_us=0.0, fsdp_unit_us=0.0, cpu_adam_params_per_s=1e30)
    measured = {c: acc.CASES[c]["measured"]["step_s"] for c in acc.CASES}

    def slope(case: str, name: str) -> float:
        one = dict(zero, **{name: 1000.0})
        return (step(case, **one) - step(case, **zero)) / 1000.0

    g = (measured["zero2"] - step("zero2", **zero)) / slope("zero2", "grad_hook_us")
    u = (measured["fsdp2"] - step("fsdp2", **zero)) / slope("fsdp2", "fsdp_unit_us")
    # ZeRO-3 and LoRA ZeRO-3: two equations in the per-tensor gradient hook and the per-module fetch
    a = [[slope(c, "z3_grad_hook_us"), slope(c, "z3_fetch_us")] for c in ("zero3", "lora-zero3")]
    y = [measured[c] - step(c, **zero) for c in ("zero3", "lora-zero3")]
    det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
    g3 = (y[0] * a[1][1] - a[0][1] * y[1]) / det
    f = (a[0][0] * y[1] - a[1][0] * y[0]) / det
    without = step("zero2-offload-optimizer-cpu", **dict(zero, grad_hook_us=g))
    acc_case = acc.CASES["zero2-offload-optimizer-cpu"]
    params = acc.MEASURED["model"]["total_params"]
    rate = params / max(1e-9, measured["zero2-offload-optimizer-cpu"] - without)
    print("fitted (us per item per micro-step; CPU Adam parameters per second):")
    print(
        f"  grad_hook_us={g:.0f} fsdp_unit_us={u:.0f} z3_grad_hook_us={g3:.0f} z3_fetch_us={f:.0f} "
        f"cpu_adam_params_per_s={rate:.3g}"
    )
    print(
        f"  (fixed: launch_us={base.launch_us:g}, step_fixed_s={base.step_fixed_s:g}, "
        f"z3_module_us={base.z3_module_us:g}; the offload case measured {acc_case['measured']['step_s']:.3f} s)"
    )
    print("\ndefaults in ftkit/plan/speed.py against the measurements:")
    for c in acc.CASES:
        p = step(c)
        print(f"  {c:<28} predicted {p:.3f} s, measured {measured[c]:.3f} s ({(p - measured[c]) / measured[c]:+.0%})")


def _cpu(runs: list[str]) -> None:
    from ftkit.plan.calibrate import measured_step
    from ftkit.plan.plan import calibration_points

    points = calibration_points(runs, "cpu")
    for p in points:
        print(
            f"{p.run}: measured {p.measured_s:.3f} s/step; model gpu {p.gpu_s:.3f} host {p.host_s:.3f} other "
            f"{p.other_s:.3f} -> {p.predicted(1, 1):.3f} s ({(p.predicted(1, 1) - p.measured_s) / p.measured_s:+.0%})"
        )
    missing = [r for r in runs if r not in {p.run for p in points}]
    for r in missing:
        print(f"{r}: no measurement ({measured_step(r)})")
    cal = speed.fit("cpu", points, "cpu runs")
    print(
        f"least-squares scales of the CPU defaults: GPU x{cal.gpu_scale:.3f}, host x{cal.host_scale:.3f}; "
        f"leave-one-out error {cal.error:.0%}"
    )
    print(json.dumps([p.as_json() for p in points], indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--h200", action="store_true")
    ap.add_argument("--cpu", nargs="+", metavar="RUN_DIR")
    args = ap.parse_args(argv)
    if args.cpu:
        _cpu(args.cpu)
    if args.h200 or not args.cpu:
        _h200()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
