"""Real 2-rank CPU runs through ``ftkit launch`` (issue 4's acceptance): every ZeRO stage and offload, LoRA, each
engine, resume without loss, a save killed part-way, and bad data coming back as one clean line.

Runs are expensive (~15-40 s each on 2 cores), so a run is made once per module and shared: the stage-2 and
stage-3 runs of the matrix are also the references for the engine and resume comparisons (``Runs.get``). On CPU
the math is deterministic, so "nothing lost" and "the same run under another engine" are checked as per-step
losses equal to 1e-6.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ftkit.checkpoint.layout import COMMIT_FILE
from ftkit.checkpoint.verify import verify
from tests.helpers.runs import assert_no_process_left, events, free_port, ftkit, mp_lock, write_recipe

pytestmark = pytest.mark.slow

STEPS = 8  # with SAVE_STEPS: checkpoint-4 and checkpoint-8, both kept (save_total_limit 2)
SAVE_STEPS = 4
# Adapters learn slowly at the full fine-tuning rate (1e-3: loss 6.06 -> 5.98 in 8 steps); 1e-2 is a usual LoRA rate.
LORA = {"peft__r": 8, "peft__target_modules": ["q_proj", "v_proj"], "train__learning_rate": 1e-2}
CONFIGS: dict[str, dict[str, Any]] = {
    "zero1": {"zero__stage": 1},
    "zero2": {"zero__stage": 2},
    "zero3": {"zero__stage": 3},
    "zero2-offload-optimizer": {"zero__stage": 2, "zero__offload_optimizer": "cpu"},
    "zero3-offload-params": {"zero__stage": 3, "zero__offload_params": "cpu", "zero__offload_optimizer": "cpu"},
    "lora-zero2": {"zero__stage": 2, **LORA},
    "lora-zero3": {"zero__stage": 3, **LORA},
}
FIRST_RUN_S = 600  # the first offload run JIT-compiles DeepSpeed's CPU Adam (1-2 min, then cached)
RUN_S = 300


@dataclass
class Run:
    path: Path  # the run directory (train.output_dir)
    proc: subprocess.CompletedProcess
    seconds: float

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def explain(self) -> str:
        """What to read when a run did not do what the test expected: ftkit's output and the ranks' log tails."""
        text = [f"exit {self.proc.returncode} after {self.seconds:.0f}s", self.output[-4000:]]
        for log in sorted(self.path.glob("logs/attempt-*/*.log")):
            text.append(f"--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(text)


def launch(
    directory: Path,
    fixtures: dict[str, Path],
    *cli: str,
    env: dict[str, str] | None = None,
    timeout: float = RUN_S,
    **overrides: Any,
) -> Run:
    """``ftkit launch`` on a recipe in ``directory`` (run directory ``directory/run``), holding the mp lock."""
    directory.mkdir(parents=True, exist_ok=True)
    recipe = directory / "recipe.yaml"
    if overrides or not recipe.exists():
        recipe = write_recipe(directory, fixtures, **overrides)
    with mp_lock():
        t0 = time.monotonic()
        proc = ftkit("launch", str(recipe), *cli, env=env, timeout=timeout)
        return Run(directory / "run", proc, time.monotonic() - t0)


class Runs:
    """Runs made once per module, by name, so one run can serve several checks."""

    def __init__(self, root: Path, fixtures: dict[str, Path]):
        self.root = root
        self.fixtures = fixtures
        self.done: dict[str, Run] = {}

    def get(self, name: str, timeout: float = RUN_S, **overrides: Any) -> Run:
        if name not in self.done:
            base = {"train__max_steps": STEPS, "train__save_steps": SAVE_STEPS}
            self.done[name] = launch(self.root / name, self.fixtures, timeout=timeout, **base, **overrides)
        return self.done[name]


@pytest.fixture(scope="module")
def fixtures(fx: dict[str, Path]) -> dict[str, Path]:
    return fx  # conftest's, made once per session


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, fixtures: dict[str, Path]) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"), fixtures)


# ------------------------------------------------------------------------------------------------------- checks


def logged_losses(run_dir: Path, attempt: int | None = None) -> dict[int, float]:
    """Per-step loss from metrics.jsonl, of one attempt or (None) the latest value of each step."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "loss" in m and (attempt is None or m["attempt"] == attempt):
            out[int(m["step"])] = float(m["loss"])
    return out


def commit_seconds(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m["commit_s"] for m in map(json.loads, lines) if m.get("event") == "commit"]


def assert_checkpoints_committed(run_dir: Path, expected: set[str]) -> None:
    """Every checkpoint left is committed and its commit record verifies with checksums; the final model too."""
    left = {p.name for p in run_dir.glob("checkpoint-*")}
    assert left == expected, f"checkpoints left: {sorted(left)}"
    for name in sorted(left):
        v = verify(run_dir / name, checksums=True)
        assert v.ok and v.committed, v.reason
    assert (run_dir / "final" / COMMIT_FILE).is_file(), "final model has no commit record"
    v = verify(run_dir / "final", checksums=True)
    assert v.ok and v.committed, v.reason


def assert_loss_falls(losses: dict[int, float]) -> None:
    steps = sorted(losses)
    assert steps == list(range(1, STEPS + 1)), f"logged steps {steps}"
    first, last3 = losses[steps[0]], [losses[s] for s in steps[-3:]]
    assert sum(last3) / 3 < first - 0.1, f"loss did not fall: {first:.4f} -> {last3}"


def final_logits_match_probe(run_dir: Path, fixtures: dict[str, Path], lora: bool) -> None:
    """Load RUN/final as a user would (LoRA: base model + adapter) and compare logits with what the trained
    in-memory model gave on the same input (probe.json, written by rank 0 after training)."""
    import torch
    from transformers import AutoModelForCausalLM

    probe = json.loads((run_dir / "ftkit" / "probe.json").read_text())
    final = run_dir / "final"
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(fixtures["model"]), final)
    else:
        model = AutoModelForCausalLM.from_pretrained(final)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(probe["input_ids"])).logits.float()
    expected = torch.tensor(probe["logits"])
    assert logits.shape == expected.shape
    diff = (logits - expected).abs().max().item()
    assert diff < 1e-4, f"final model's logits differ from the trained model's by {diff:.2e}"
    # The probe must come from a trained model (a probe of the untrained base would make the check above hollow):
    # measured differences from the base are ~1.4 (full) and ~0.86 (LoRA) after 8 steps.
    base = AutoModelForCausalLM.from_pretrained(fixtures["model"]).eval()
    with torch.no_grad():
        untrained = base(input_ids=torch.tensor(probe["input_ids"])).logits.float()
    assert (untrained - expected).abs().max().item() > 0.1


# -------------------------------------------------------------------------------------------------------- tests


@pytest.mark.timeout(FIRST_RUN_S + 60)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_and_lora_runs_train_commit_and_save_a_loadable_model(
    name: str, shared: Runs, fixtures: dict[str, Path]
) -> None:
    run = shared.get(name, timeout=FIRST_RUN_S, **CONFIGS[name])
    try:
        assert run.proc.returncode == 0, run.explain()
        assert_loss_falls(logged_losses(run.path))
        assert_checkpoints_committed(run.path, {"checkpoint-4", "checkpoint-8"})
        assert len(commit_seconds(run.path)) == 2
        final_logits_match_probe(run.path, fixtures, lora="peft__r" in CONFIGS[name])
    finally:
        assert_no_process_left(run.path)


# Each engine runs the same math: test_recovery's per-engine kill tests hold accelerate's and torchrun's losses, every
# step, to the deepspeed engine's uninterrupted run (1e-6), and test_graceful_stop's do the same for 40 steps.


@pytest.mark.timeout(3 * RUN_S)
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_a_checkpoint_loses_nothing(stage: int, shared: Runs, tmp_path: Path) -> None:
    name = f"zero{stage}"
    reference = shared.get(name, **CONFIGS[name])
    k = SAVE_STEPS
    # First launch stops after checkpoint-k (the last committed one); the second asks for all steps and resumes.
    first = launch(
        tmp_path,
        shared.fixtures,
        f"train.max_steps={k}",
        **CONFIGS[name],
        train__max_steps=STEPS,
        train__save_steps=SAVE_STEPS,
    )
    try:
        assert first.proc.returncode == 0, first.explain()
        assert sorted(logged_losses(first.path)) == list(range(1, k + 1))
        # The same recipe file (max_steps=STEPS); a fresh port: see test_relaunch_right_after_a_run_on_the_same_port.
        second = launch(tmp_path, shared.fixtures, f"cluster.master_port={free_port()}")
        assert second.proc.returncode == 0, second.explain()
        chosen = [e for e in events(first.path) if e["event"] == "checkpoint_chosen"]
        assert [(Path(e["checkpoint"]).name, e["step"]) for e in chosen] == [(f"checkpoint-{k}", k)], chosen
        resumed = logged_losses(first.path, attempt=chosen[0]["attempt"])
        assert sorted(resumed) == list(range(k + 1, STEPS + 1)), "the second launch did not start at step k+1"
        ref = logged_losses(reference.path)
        assert reference.proc.returncode == 0, reference.explain()
        for step, loss in resumed.items():
            assert loss == pytest.approx(ref[step], abs=1e-6), f"step {step} after resume vs uninterrupted"
        assert_checkpoints_committed(first.path, {"checkpoint-4", "checkpoint-8"})
    finally:
        assert_no_process_left(first.path)


@pytest.mark.timeout(RUN_S)
def test_save_killed_part_way_leaves_no_commit_and_keeps_the_previous_checkpoint(
    tmp_path: Path, fixtures: dict[str, Path]
) -> None:
    run = launch(
        tmp_path,
        fixtures,
        env={"FTKIT_FAULT_INJECT": f"kill_in_save:1:{STEPS}"},
        train__max_steps=STEPS,
        train__save_steps=SAVE_STEPS,
        train__save_total_limit=1,
        resilience__max_restarts=0,
    )
    try:
        assert run.proc.returncode == 4, run.explain()  # restart budget (0) exhausted
        assert "SIGKILL while saving" in (run.path / "logs" / "attempt-0" / "rank-1.log").read_text()
        torn = run.path / f"checkpoint-{STEPS}"
        assert torn.is_dir() and (torn / "latest").exists(), "the save should have got as far as DeepSpeed's shards"
        assert not (torn / COMMIT_FILE).exists()
        v = verify(torn, checksums=True)
        assert not v.ok and v.kind == "no_commit", v.reason
        kept = run.path / f"checkpoint-{SAVE_STEPS}"
        v = verify(kept, checksums=True)
        assert v.ok and v.committed, v.reason
        assert {p.name for p in run.path.glob("checkpoint-*")} == {kept.name, torn.name}
        assert not (run.path / "final" / COMMIT_FILE).exists()
        assert [e["event"] for e in events(run.path)][-1:] == ["gave_up"]
    finally:
        assert_no_process_left(run.path)


# make test-extended (CI budget): in make test, the graceful-stop test's and the resume-changes test's relaunches come
# right after a run of the same recipe, port included
@pytest.mark.extended
@pytest.mark.timeout(2 * RUN_S)
def test_relaunch_right_after_a_run_on_the_same_port(tmp_path: Path, fixtures: dict[str, Path]) -> None:
    first = launch(tmp_path, fixtures, train__max_steps=2, train__save_steps=2)
    try:
        assert first.proc.returncode == 0, first.explain()
        second = launch(tmp_path, fixtures, "train.max_steps=3")  # same recipe, same cluster.master_port
        assert "already in use" not in second.output, second.output
        assert second.proc.returncode == 0, second.explain()
        assert sorted(logged_losses(first.path, attempt=1)) == [3]
    finally:
        assert_no_process_left(first.path)


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


BAD_DATA = {
    # name: (file content or None for a missing file, extra overrides, what the error must say besides the path)
    "missing": (None, {}, "file not found"),
    "empty": ([], {}, "empty"),
    "wrong-fields": ([json.dumps({"text": "the sky is blue"}), json.dumps({"question": "what colour?"})], {}, ":2:"),
    "too-long": (
        [json.dumps({"text": "the sky is blue"})] * 2 + [json.dumps({"text": " ".join(["apple"] * 200)})],
        {"data__max_seq_len": 32},
        ":3:",
    ),
}


@pytest.mark.timeout(RUN_S)
@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_ends_with_one_clean_line_and_no_restart(case: str, tmp_path: Path, fixtures: dict[str, Path]) -> None:
    content, overrides, says = BAD_DATA[case]
    data = tmp_path / f"bad-{case}.jsonl"
    if content is not None:
        _write_lines(data, content)
    run = launch(tmp_path, fixtures, data__train=str(data), **overrides)
    try:
        assert run.proc.returncode == 2, run.explain()
        assert "Traceback" not in run.output, run.explain()
        errors = [line for line in run.output.splitlines() if line.startswith("ftkit: error:")]
        assert errors, run.explain()
        assert any(str(data) in line and says in line for line in errors), errors
        assert len(errors) == len(set(errors)), f"the same error reported twice: {errors}"
        names = [e["event"] for e in events(run.path)]
        if case == "missing":  # caught before anything starts (validated at the boundary)
            assert "launch" not in names and "spawn" not in names, names
        else:  # row-level checks happen on the ranks and must come back through the supervisor
            assert "gave_up" in names and "restart" not in names, names
            assert names.count("launch") == 1, names
    finally:
        assert_no_process_left(run.path)
