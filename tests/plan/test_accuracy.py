"""``ftkit plan`` against what a GPU measured (issue 37's acceptance): tests/plan/data/h200-2026-11-27.json holds the
numbers of ../shared/gpu/measurements-2026-11-27.json (a 0.27B Llama on one H200, bf16, seq 1024, micro batch 8, the
built-in entry under ``ftkit launch``: ZeRO-2, ZeRO-3, LoRA ZeRO-3, ZeRO-2 + optimizer offload, FSDP2).

The plans use the model's traced profile as ``ftkit plan`` would find it in its cache: tests/plan/data/
trace-llama-0.27b.json holds ``python -m ftkit.launch.trace``'s answers for that model (tests/launch/test_trace.py
traces it again and checks they still hold). The planner at main 17586c7 predicted 44-57% too much memory and 4-18x
too little time: each test here fails on it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftkit.cli.main import cli
from ftkit.plan import profile
from ftkit.plan.inputs import profile_request
from ftkit.recipe.load import load_recipe

DATA = Path(__file__).parent / "data"
MEASURED = json.loads((DATA / "h200-2026-11-27.json").read_text())
TRACES = json.loads((DATA / "trace-llama-0.27b.json").read_text())
CASES = {c["case"]: c for c in MEASURED["cases"]}
GPU_GIB = 143771 / 1024  # the H200's 143771 MiB
RANKING = ["fsdp2", "zero2", "zero3", "lora-zero3"]  # fastest first, as measured


def _overrides(case: dict[str, object]) -> list[str]:
    if case.get("backend") == "fsdp2":
        return ["train.backend=fsdp2", f"fsdp.reshard_after_forward={str(case['reshard_after_forward']).lower()}"]
    out = [f"zero.stage={case['zero_stage']}", f"zero.offload_optimizer={case['offload_optimizer']}"]
    out.append(f"zero.offload_params={case['offload_params']}")
    if case["lora"]:
        out += ["peft.method=lora", "peft.r=16", "peft.alpha=32", "peft.target_modules=[q_proj,k_proj,v_proj,o_proj]"]
    return out


@pytest.fixture
def h200(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A recipe of the measured workload, with the model's traced profiles in an isolated profile cache."""
    m, w = MEASURED["model"], MEASURED["workload"]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TRACES["config"]))
    assert TRACES["config"]["hidden_size"] == m["hidden_size"] and TRACES["config"]["vocab_size"] == m["vocab_size"]
    (tmp_path / "data.jsonl").write_text('{"text": "x"}\n')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(
            f"""\
            model: {{path: ./model}}
            data: {{train: ./data.jsonl, max_seq_len: {w["seq_len"]}}}
            train:
              output_dir: ./run
              precision: {w["precision"]}
              micro_batch_size: {w["micro_batch_size"]}
              global_batch_size: {w["micro_batch_size"] * w["grad_accum"]}
            cluster: {{gpus_per_node: 1, gpu_memory_gb: {GPU_GIB:.1f}, gpu: h200, host_memory_gb: 1024}}
            """
        )
    )
    cache = tmp_path / "profiles"
    cache.mkdir()
    libs = profile._libraries()
    for name, case in (("full", CASES["zero2"]), ("lora", CASES["lora-zero3"])):
        r = load_recipe(str(recipe), _overrides(case))
        req = profile_request(r, TRACES["config"])  # as the planner asks: the answer is filed under its key
        assert req.as_json() == TRACES[name]["request"], "tests/plan/data/trace-llama-0.27b.json is stale"
        (cache / f"{profile.cache_key(req, libs)}.json").write_text(json.dumps(TRACES[name]["answer"]))
    monkeypatch.setenv("FTKIT_PROFILE", "auto")
    monkeypatch.setenv("FTKIT_PROFILE_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    return recipe


def plan_json(recipe: Path, *args: str) -> dict:
    r = CliRunner().invoke(cli, ["plan", str(recipe), *args, "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


@pytest.mark.parametrize("name", sorted(CASES))
def test_memory_is_within_10_percent_of_the_h200_measurement(h200: Path, name: str) -> None:
    """The device total (allocator peak + the caching allocator's reserve + CUDA context, cuBLAS, NCCL) against
    nvidia-smi's peak, and the allocator's peak against torch.cuda.max_memory_allocated() where it was read."""
    case = CASES[name]
    data = plan_json(h200, *_overrides(case))
    sel = data["selected"]
    measured = case["measured"]
    assert data["activations"].startswith("activations traced"), data["activations"]
    device = sel["gpu_gib"]
    assert abs(device - measured["device_gib"]) <= 0.10 * measured["device_gib"], (name, device, measured)
    if measured["allocator_gib"] is not None:
        alloc = sel["allocator_gib"]
        assert abs(alloc - measured["allocator_gib"]) <= 0.10 * measured["allocator_gib"], (name, alloc, measured)
    old = case["predicted"]["gpu_gib"]  # the planner at 17586c7, for the record: 44-57% high
    assert old > 1.4 * measured["device_gib"]


def test_the_plan_says_its_activations_were_traced(h200: Path) -> None:
    data = plan_json(h200, "zero.stage=2")
    assert data["activations"].startswith("activations traced: cached"), data["activations"]


def _measured_run(
    root: Path, recipe: Path, overrides: list[str], step_s: float, steps: int = 12, name: str = "measured-run"
) -> Path:
    """A run directory recording the H200 run of one case: its spec (the hosts), the resolved recipe and rank 0's
    metrics, one logged step every ``step_s`` seconds."""
    run = root / name
    (run / "ftkit").mkdir(parents=True)
    r = load_recipe(str(recipe), overrides)
    (run / "ftkit" / "spec.json").write_text(json.dumps({"hosts": [["localhost", 1]]}))
    (run / "ftkit" / "recipe.json").write_text(json.dumps(r.to_dict()))
    lines = [{"step": s, "attempt": 0, "time": 1000.0 + s * step_s, "loss": 5.0} for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def test_calibrated_on_zero2_alone_the_other_step_times_are_within_25_percent_and_rank_as_measured(
    h200: Path, tmp_path: Path
) -> None:
    """``--calibrate`` with the ZeRO-2 run's step time alone; the calibration is kept beside the recipe's run directory,
    so the plans of the other cases (the same run directory) use it: each within 25% of its measured step time, and
    predicted FSDP2 < ZeRO-2 < ZeRO-3 < LoRA ZeRO-3 as measured."""
    z2 = CASES["zero2"]
    run = _measured_run(tmp_path, h200, _overrides(z2), z2["measured"]["step_s"])
    data = plan_json(h200, *_overrides(z2), "--calibrate", str(run))
    assert data["calibration"]["points"][0]["measured_s"] == pytest.approx(z2["measured"]["step_s"])
    assert data["calibration_stored"] == str(tmp_path / "run" / "ftkit" / "calibration.json")
    predicted = {}
    for name, case in CASES.items():
        sel = plan_json(h200, *_overrides(case))["selected"]
        predicted[name] = sel["step_time_s"]
        measured = case["measured"]["step_s"]
        assert abs(predicted[name] - measured) <= 0.25 * measured, (name, predicted[name], measured)
        assert "uncalibrated" not in sel["assumptions"]["calibration"]
    assert sorted(RANKING, key=predicted.__getitem__) == RANKING, predicted


def test_uncalibrated_step_times_are_within_2x_and_say_so(h200: Path) -> None:
    for name, case in CASES.items():
        data = plan_json(h200, *_overrides(case))
        sel = data["selected"]
        measured = case["measured"]["step_s"]
        assert measured / 2 <= sel["step_time_s"] <= 2 * measured, (name, sel["step_time_s"], measured)
        assert sel["assumptions"]["calibration"] == "uncalibrated" and data["calibration"] is None
    out = CliRunner().invoke(cli, ["plan", str(h200), "zero.stage=2"], catch_exceptions=False).output
    assert "step times uncalibrated" in out


def test_a_run_directory_calibrates_the_next_plan_of_its_recipe(h200: Path, tmp_path: Path) -> None:
    """No --calibrate: the recipe's own run directory measured earlier attempts (ZeRO-2's step time), and the next plan
    of the recipe (here for ZeRO-3) is calibrated by them."""
    z2, z3 = CASES["zero2"], CASES["zero3"]
    _measured_run(tmp_path, h200, _overrides(z2), z2["measured"]["step_s"], name="run")  # train.output_dir: ./run
    data = plan_json(h200, *_overrides(z3))
    assert [p["run"] for p in data["calibration"]["points"]] == [str(tmp_path / "run")]
    assert abs(data["selected"]["step_time_s"] - z3["measured"]["step_s"]) <= 0.25 * z3["measured"]["step_s"]
    out = CliRunner().invoke(cli, ["plan", str(h200), *_overrides(z3)], catch_exceptions=False).output
    assert "step times calibrated on 1 measured run" in out and "expected error ±25%" in out
