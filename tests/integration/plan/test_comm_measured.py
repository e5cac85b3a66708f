"""Bytes per optimizer step measured on real ranks: DeepSpeed's comms logger on 2 CPU ranks (HF Trainer + DeepSpeed,
benchmarks/step_time.py's harness) against ftkit.plan.comm's prediction for the same recipe, collective by collective.
The quick tests pinning the prediction to measured numbers are tests/plan/test_comm.py.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers.paths import REPO

CASES = [(stage, ga, kind) for kind in ("full", "lora") for stage in (1, 2, 3) for ga in (1, 4)]


@pytest.fixture(scope="module")
def comm_runs(tmp_path_factory: pytest.TempPathFactory, fx):
    """Each case on 2 CPU ranks (HF Trainer + DeepSpeed with comms_logger on), 3 optimizer steps each."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import step_time

    from tests.helpers.runs import mp_lock, write_recipe

    root = tmp_path_factory.mktemp("comm")
    with mp_lock():  # bytes, not seconds: another run beside these changes nothing they assert
        recipe = write_recipe(root, fx)
        # All twelve cases on one pair of ranks, one after another (a fresh Trainer and DeepSpeed engine each): the
        # libraries' import is paid once, not twelve times.
        names = {f"z{stage}-ga{ga}-{kind}": (stage, ga, kind) for stage, ga, kind in CASES}
        cases = {n: step_time.case_overrides(st, ga, kind == "lora", steps=3) for n, (st, ga, kind) in names.items()}
        res = step_time.measure_many(str(recipe), cases, root / "runs")
    return {names[n]: r for n, r in res.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"zero{s}-ga{g}-{k}" for s, g, k in CASES])
def test_logged_bytes_per_step_equal_the_plan_within_10_percent(case, comm_runs) -> None:
    """DeepSpeed's comms logger on real ranks vs ftkit's prediction for the same recipe, collective by collective
    (the start-up broadcasts, and HF Trainer's own small broadcasts, excluded)."""
    import step_time

    res = comm_runs[case]
    predicted = res["prediction"].logger_bytes
    assert res["plan"].stage == case[0] and res["plan"].grad_accum == case[1]
    for rank, steps in enumerate(res["ranks"]):
        assert len(steps) == 3
        for i, step in enumerate(steps[1:], start=1):  # step 0 at stage 3 runs before DeepSpeed has a trace
            measured = {op: b for op, b in step_time.bytes_by_op(step["calls"]).items() if op != "broadcast"}
            assert set(measured) == set(predicted), (rank, i, measured, predicted)
            for op, b in predicted.items():
                assert abs(measured[op] - b) <= 0.10 * b, (rank, i, op, measured[op], b)
