"""Wrapping a user's HF Trainer script: ``ftkit launch RECIPE [--no-inject] -- CMD`` with real 2-rank CPU runs.

The scripts (tests/scripts/, and the ``ftkit.hf`` example of docs/own-script.md) never change for ftkit: the import
hook serves them. Each run is 8 steps, checkpoints every 4; a kill test SIGKILLs rank 1 after step 6
(``FTKIT_FAULT_INJECT`` rides on ftkit's callbacks, so it reaches a wrapped script too) and expects one restart from
checkpoint-4 and the losses of an uninterrupted run. One kill test per engine; the other runs are single attempts.
Without ranks: tests/command/test_wrap.py (the dry run, command mistakes) and tests/launch/test_hook.py (the hook
itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ftkit.errors import ExitCode
from tests.helpers.paths import REPO, SCRIPTS
from tests.helpers.readme import readme_example
from tests.helpers.runs import assert_no_process_left, losses, mp_lock, named, script_command, write_recipe

STEPS = 8
RUN_S = 300
KILL = {"FTKIT_FAULT_INJECT": "kill:1:6"}  # rank 1 SIGKILLs itself after step 6 of attempt 0


def _recipe(tmp_path: Path, fx: dict[str, Path], **kw: Any) -> tuple[Path, Path]:
    recipe = write_recipe(tmp_path, fx, train__max_steps=STEPS, **kw)
    return recipe, tmp_path / "run"


def launch(recipe: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    e = {k: v for k, v in os.environ.items() if k != "FTKIT_FAULT_INJECT"}
    e.update({"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})})
    with mp_lock():
        r = subprocess.run(
            [sys.executable, "-m", "ftkit", "launch", str(recipe), *args],
            capture_output=True,
            text=True,
            env=e,
            timeout=RUN_S,
            cwd=cwd or recipe.parent,
        )
    return r


def hf_script(fx: dict[str, Path], *extra: str) -> list[str]:
    return script_command("hf_trainer.py", fx, *extra)


def assert_recovered(r: subprocess.CompletedProcess, run: Path, expected: dict[int, float]) -> None:
    """Exit 0 after exactly one restart from checkpoint-4, every step's loss equal to the uninterrupted run's."""
    assert r.returncode == ExitCode.OK, r.stdout[-4000:] + r.stderr[-3000:]
    assert len(named(run, "restart")) == 1, named(run, "restart")
    chosen = [e for e in named(run, "checkpoint_chosen") if e["attempt"] == 1]
    assert [Path(e["checkpoint"]).name for e in chosen] == ["checkpoint-4"], chosen
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    diffs = {s: (got[s], expected[s]) for s in got if abs(got[s] - expected[s]) > 1e-6}
    assert not diffs, f"losses differ from the uninterrupted run (step: got, expected): {diffs}"
    assert (run / "final" / "ftkit_commit.json").is_file()
    assert_no_process_left(run)


@pytest.fixture(scope="module")
def hf_baseline(fx: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The plain HF Trainer script, uninterrupted, on the deepspeed engine: its losses are the reference."""
    d = tmp_path_factory.mktemp("hf-baseline")
    recipe, run = _recipe(d, fx)
    r = launch(recipe, "--", *hf_script(fx, "--logging_steps", "1", "--report_to", "none"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    # the script asked HF for get_last_checkpoint (resume_from_checkpoint=True): ftkit's choice (none) won, listed
    rows = json.loads((run / "ftkit" / "attempts" / "0" / "args_changes.json").read_text())
    assert {"name": "resume_from_checkpoint", "from": True, "to": None} in rows, rows
    spec = json.loads((run / "ftkit" / "spec.json").read_text())  # the command given after `--` is recorded
    assert spec["command"][:2] == ["python", str(SCRIPTS / "hf_trainer.py")], spec["command"]
    assert not named(run, "restart")
    assert_no_process_left(run)
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


# ------------------------------------------------------------------------------------------------ TRL


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("killed", [False, True], ids=["clean", "killed"])
def test_unmodified_trl_script_gets_the_recipe_and_survives_a_killed_rank(fx, tmp_path, killed):
    """TRL's SFTTrainer in a script that never imports ftkit: the recipe's values win over the script's arguments
    (each change listed once, in the output and in events.jsonl); ``killed`` (make test-extended: TRL's DPOTrainer
    script is killed and resumes in a matrix cell of make test): a SIGKILLed rank costs one restart and no loss."""
    cmd = script_command(
        "trl_sft.py",
        fx,
        "--output_dir",
        str(tmp_path / "elsewhere"),
        "--per_device_train_batch_size",
        "7",
        "--bf16",
        "true",
        "--deepspeed",
        str(tmp_path / "their_ds.json"),
        "--logging_steps",
        "1",
        "--report_to",
        "none",
    )
    (tmp_path / "their_ds.json").write_text(json.dumps({"train_batch_size": 14, "zero_optimization": {"stage": 3}}))
    clean_dir, kill_dir = tmp_path / "clean", tmp_path / "kill"
    clean_dir.mkdir()
    kill_dir.mkdir()
    recipe, run = _recipe(clean_dir, fx)
    r = launch(recipe, "--", *cmd)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    out = r.stdout
    for line in (
        f"output_dir: '{tmp_path / 'elsewhere'}' -> '{run}'",
        "per_device_train_batch_size: 7 -> 4",
        "gradient_accumulation_steps: 1 -> 2",
        "bf16: True -> False",
        f"deepspeed: '{tmp_path / 'their_ds.json'}' -> '{run / 'ftkit' / 'ds_config.json'}'",  # replaced, not merged
        "max_steps: -1 -> 8",
        "save_steps: 500 -> 4",
    ):
        assert out.count(line) == 1, (line, out[-4000:])
    (changed,) = named(run, "args_changed")
    names = [c["name"] for c in changed["changes"]]
    assert len(names) == len(set(names)) and {"output_dir", "per_device_train_batch_size", "deepspeed"} <= set(names)
    assert not (tmp_path / "elsewhere").exists()  # nothing went where the script said: the run directory is ftkit's
    assert json.loads((run / "ftkit" / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2
    expected = losses(run)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert_no_process_left(run)
    if not killed:
        return

    recipe, run = _recipe(kill_dir, fx)
    r = launch(recipe, "--", *cmd, env=KILL)
    assert_recovered(r, run, expected)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trl_console_command_runs_trls_own_sft_script(fx, tmp_path):
    """`trl sft` is an accelerate-launch wrapper: ftkit runs `python -m trl.scripts.sft` on every rank itself
    (offline, a local dataset directory), says so, and TRL's unmodified script trains and finishes."""
    data_dir = tmp_path / "dataset"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text(fx["data"].read_text())
    recipe, run = _recipe(tmp_path, fx, cluster__engine="torchrun")
    args = ["--model_name_or_path", str(fx["model"]), "--dataset_name", str(data_dir), "--report_to", "none"]
    dry = launch(recipe, "--dry-run", "--", "trl", "sft", *args)
    assert dry.returncode == 0, dry.stderr
    assert "-m trl.scripts.sft --model_name_or_path" in dry.stdout and "accelerate-launch wrapper" in dry.stdout
    assert "import hook:" in dry.stdout and "PYTHONPATH=" + str(REPO / "launch" / "inject") in dry.stdout
    r = launch(recipe, "--", "trl", "sft", *args)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    assert (run / "final" / "ftkit_commit.json").is_file()
    assert_no_process_left(run)


# ------------------------------------------------------------------------------------------------ plain HF Trainer


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["deepspeed", "accelerate", "torchrun"])
def test_unmodified_hf_trainer_script_survives_a_killed_rank(engine, fx, hf_baseline, tmp_path):
    """The HfArgumentParser script, killed mid-run, on each engine: one restart, the uninterrupted run's losses."""
    recipe, run = _recipe(tmp_path, fx, cluster__engine=engine)
    r = launch(recipe, "--", *hf_script(fx, "--logging_steps", "1", "--report_to", "none"), env=KILL)
    assert_recovered(r, run, hf_baseline)


@pytest.mark.slow
# CI (issue 39): HF Trainer applies AutoTP from ds_config.json alike for the built-in entry and a script: the built-in
# entry's TP run (tests/integration/parallel) checks the TP shards, the layout and the exact resume; scripts under a
# kill are this module's
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_unmodified_hf_trainer_script_under_tensor_parallelism_survives_a_killed_rank(fx, hf_baseline, tmp_path):
    """Issue 40: the same script with parallel.tp 2 (DeepSpeed AutoTP, which HF Trainer applies from ds_config.json):
    each TP rank saves its own shards, a killed rank resumes, and every loss equals the 2-rank data-parallel run's
    (the same global batch: accumulation 4 x 1 data-parallel rank)."""
    recipe, run = _recipe(tmp_path, fx, parallel__tp=2)
    r = launch(recipe, "--", *hf_script(fx, "--logging_steps", "1", "--report_to", "none"), env=KILL)
    assert "x 1 data-parallel rank(s); layout tp 2 x sp 1 x dp 1" in r.stdout, r.stdout[:2000]
    assert_recovered(r, run, hf_baseline)
    shards = sorted(p.name for p in (run / "checkpoint-8" / "global_step8").iterdir())
    assert "mp_rank_01_model_states.pt" in shards and "zero_pp_rank_0_mp_rank_01_optim_states.pt" in shards, shards


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("killed", [False, True], ids=["clean", "killed"])
def test_readme_explicit_ftkit_hf_example_with_no_inject_survives_a_killed_rank(fx, hf_baseline, tmp_path, killed):
    """The explicit ftkit.hf script of docs/own-script.md, run as written with --no-inject on torchrun: no hook on its
    path, and the same losses as the unmodified script under the hook; ``killed`` (make test-extended): a SIGKILLed
    rank costs one restart from checkpoint-4 and no loss. (In make test, ``ftkit.hf.resume_checkpoint()`` after a
    kill is the loop API test's, and HF Trainer's resume from ftkit's choice the hooked script's kill test's.)"""
    (tmp_path / "train.py").write_text(readme_example())
    recipe, run = _recipe(tmp_path, fx, cluster__engine="torchrun")
    dry = launch(recipe, "--dry-run", "--no-inject", "--", "python", "train.py", "M", "D")
    assert "import hook:" not in dry.stdout and "launch/inject" not in dry.stdout, dry.stdout
    cmd = ["python", "train.py", str(fx["model"]), str(fx["data"])]
    r = launch(recipe, "--no-inject", "--", *cmd, env=KILL if killed else None)
    if killed:
        assert_recovered(r, run, hf_baseline)
    else:
        assert r.returncode == ExitCode.OK, r.stdout[-4000:] + r.stderr[-3000:]
        assert not named(run, "restart") and (run / "final" / "ftkit_commit.json").is_file()
        got = losses(run)
        assert sorted(got) == list(range(1, STEPS + 1)), got
        diffs = {s: (got[s], hf_baseline[s]) for s in got if abs(got[s] - hf_baseline[s]) > 1e-6}
        assert not diffs, f"losses differ from the hooked script's (step: got, expected): {diffs}"
        assert_no_process_left(run)
    assert "import hook installed" not in (run / "logs" / "attempt-0" / "rank-0.log").read_text()


# ------------------------------------------------------------------------------------------------ script errors


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_script_failing_at_import_stops_at_once_with_its_error(fx, tmp_path):
    """An import error is not restarted: one attempt, the error shown, exit 14 (the script failed before its
    first step), and the rank's error record carries the traceback's last lines."""
    recipe, run = _recipe(tmp_path, fx)
    r = launch(recipe, "--", "python", str(SCRIPTS / "raise_at_import.py"))
    assert r.returncode == ExitCode.SCRIPT_FAILED, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "No module named 'no_such_module_for_ftkit_tests'" in out, out[-3000:]
    assert not named(run, "restart") and len(named(run, "launch")) == 1
    records = [json.loads(p.read_text()) for p in (run / "ftkit" / "attempts" / "0" / "errors").glob("rank-*.json")]
    assert records and all(rec["exit_code"] == ExitCode.SCRIPT_FAILED and rec["step"] is None for rec in records)
    assert any("raise_at_import.py" in line for line in records[0]["traceback"]), records[0]
    # issue 35: its class in events.jsonl, and one line quoting the rank's own exception, where, its log, a hint
    (failure,) = named(run, "failure")
    assert failure["failure_class"] == "import_error" and failure["restartable"] is False, failure
    line = "ModuleNotFoundError: No module named 'no_such_module_for_ftkit_tests'"
    # both ranks fail the same way: the line names one of them and its log (rank 1 in a local CI run)
    said = ": {line} (log: {log}): a restart cannot change it (import_error) [install it"
    logs = [run / "logs" / "attempt-0" / f"rank-{n}.log" for n in failure["dead_ranks"]]
    assert [said.format(line=line, log=log) in r.stdout for log in logs].count(True) == 1, (failure, r.stdout)
    assert_no_process_left(run)


@pytest.mark.slow
@pytest.mark.extended  # CI: the built-in entry's deterministic failure (tests/integration/recovery) takes this path
@pytest.mark.timeout(600)
def test_script_failing_at_the_same_step_every_time_stops_with_its_traceback(fx, tmp_path):
    """A bug at step 5 every time (after the first step, so it is restarted once from checkpoint-4): the same
    failure at the same step stops the run through the no-progress rule, with the script's traceback shown. The
    plain HF script runs on torchrun here (its third engine)."""
    recipe, run = _recipe(tmp_path, fx, cluster__engine="torchrun")
    r = launch(recipe, "--", *hf_script(fx, "--fail_at_step", "5", "--report_to", "none"))
    assert r.returncode == ExitCode.BUDGET_EXHAUSTED, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "the script's own bug at step 5" in out, out[-3000:]
    failures = named(run, "failure")
    assert len(failures) >= 2 and all(f.get("step") in (4, 5) for f in failures), failures
    records = [json.loads(p.read_text()) for p in (run / "ftkit" / "attempts" / "0" / "errors").glob("rank-*.json")]
    assert records and all(rec["step"] == 5 for rec in records), records
    assert any("hf_trainer.py" in line for line in records[0]["traceback"]), records[0]
    assert not (run / "final").exists()
    assert_no_process_left(run)


@pytest.mark.slow
def test_a_trainer_whose_save_writes_nothing_stops_at_once_with_one_line(fx, tmp_path):
    """A Trainer overriding _save_checkpoint with nothing used to fail every commit with HF's traceback
    (CommitError: not a directory), three attempts, exit 4: a deterministic mistake, so exit 14 at once."""
    recipe, run = _recipe(tmp_path, fx)
    r = launch(recipe, "--", *hf_script(fx, "--save_nothing", "true", "--report_to", "none"))
    assert r.returncode == ExitCode.SCRIPT_FAILED, r.stdout[-3000:] + r.stderr[-3000:]
    assert "the Trainer's save wrote nothing" in r.stdout and "_save_checkpoint" in r.stdout, r.stdout[-3000:]
    assert "CommitError" not in r.stdout + r.stderr
    assert len(named(run, "spawn")) == 1 and not named(run, "restart")
    assert_no_process_left(run)


@pytest.mark.slow
def test_a_script_that_ignores_the_resume_is_stopped_at_its_first_step(fx, tmp_path):
    """On CPU a run that silently restarted from step 1 logs the same losses as one that resumed: the docs' script
    without the resume argument used to retrain from scratch after a failure and pass. The resumed attempt's rank
    reports the global step it began at; anything before checkpoint-K stops the run at once with exit 9."""
    recipe = write_recipe(tmp_path, fx, train__max_steps=40, cluster__engine="torchrun")
    run = tmp_path / "run"
    resume = "trainer.train(resume_from_checkpoint=ftkit.hf.resume_checkpoint())"
    script = readme_example().replace(resume, "trainer.train()")
    assert "trainer.train()" in script
    (tmp_path / "train.py").write_text(script)
    r = launch(recipe, "--no-inject", "--", "python", "train.py", str(fx["model"]), str(fx["data"]), env=KILL)
    assert r.returncode == ExitCode.RESUME_MISMATCH, r.stdout[-3000:] + r.stderr[-3000:]
    line = (
        "the script trained step 1 after ftkit resumed it from checkpoint-4: it does not pass "
        "ftkit.hf.resume_checkpoint()"
    )
    assert line in r.stdout, r.stdout[-3000:]
    again = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max((m["step"] for m in again if m.get("attempt") == 1 and "loss" in m), default=0) < 10, "stopped late"
    assert not (run / "final").exists()
    assert_no_process_left(run)


@pytest.mark.slow
def test_a_loop_without_trainer_is_not_killed_as_hung(fx, tmp_path):
    """A plain PyTorch loop under `ftkit launch -- ...` used to be reported as "no training step within
    startup_timeout_s", killed and restarted from scratch (exit 4). The hook knows no Trainer was built: one line,
    the healthy process runs on to its end, exit 0. Issue 35: the script's own environment reaches the local ranks
    whole (a variable of its own, LD_LIBRARY_PATH), as torchrun itself passes it; the allow-list dropped both."""
    # The start-up timeout runs from the engine's spawn: torchrun and the ranks took up to 8.9 s to their first
    # record on a loaded machine (a 4 s timeout failed in CI), so 30 s; the loop runs past it, so the old code, which
    # took the healthy loop for a hung start, still fails here
    recipe, run = _recipe(tmp_path, fx, cluster__engine="torchrun", resilience__startup_timeout_s=30)
    lib = os.pathsep.join(p for p in ("/opt/ftkit-35/lib", os.environ.get("LD_LIBRARY_PATH")) if p)
    env = {"MY_DATA_DIR": "/data/sets/ftkit-35", "LD_LIBRARY_PATH": lib}
    r = launch(recipe, "--", "python", str(SCRIPTS / "plain_loop.py"), "40", env=env)
    assert r.returncode == ExitCode.OK, r.stdout[-3000:] + r.stderr[-3000:]
    assert "has built no HF Trainer and does not call ftkit.hf.step()" in r.stdout, r.stdout[-3000:]
    assert len(named(run, "spawn")) == 1 and not named(run, "restart") and not named(run, "failure")
    assert "plain loop done" in (run / "logs" / "attempt-0" / "rank-0.log").read_text()
    for rank in (0, 1):
        log = (run / "logs" / "attempt-0" / f"rank-{rank}.log").read_text()
        assert "MY_DATA_DIR=/data/sets/ftkit-35" in log and f"LD_LIBRARY_PATH={lib}\n" in log, log[-2000:]
    assert_no_process_left(run)


@pytest.mark.slow
def test_an_accelerate_loop_on_the_loop_api_survives_a_killed_rank(fx, tmp_path):
    """ftkit.hf.step / checkpoint / resume_checkpoint / final serve a loop of one's own: a rank killed after the
    last step's loss was logged, a restart from checkpoint-4, and steps 5-8 recomputed equal to what was logged
    (resume_tolerance 0: any difference stops the run with exit 9)."""
    recipe, run = _recipe(tmp_path, fx, cluster__engine="torchrun", resilience__resume_tolerance=0.0)
    script = ["python", str(SCRIPTS / "accelerate_loop.py"), str(fx["model"]), str(fx["data"])]
    r = launch(recipe, "--", *script, env={"FTKIT_FAULT_INJECT": f"kill:1:{STEPS}"})
    assert r.returncode == ExitCode.OK, r.stdout[-4000:] + r.stderr[-3000:]
    chosen = [Path(e["checkpoint"]).name for e in named(run, "checkpoint_chosen")]
    assert chosen == ["checkpoint-4"] and len(named(run, "restart")) == 1, named(run, "checkpoint_chosen")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first = {m["step"]: m["loss"] for m in rows if "loss" in m and m["attempt"] == 0}
    again = {m["step"]: m["loss"] for m in rows if "loss" in m and m["attempt"] == 1}
    assert sorted(first) == list(range(1, STEPS + 1)) and sorted(again) == list(range(5, STEPS + 1)), (first, again)
    assert all(first[s] == again[s] for s in again), (first, again)
    assert (run / "checkpoint-8" / "ftkit_commit.json").is_file() and (run / "final" / "ftkit_commit.json").is_file()
    # both ranks are processes of one Accelerate job (each saved its own RNG state), not two jobs of one process
    assert sorted(p.name for p in (run / "checkpoint-8").glob("random_states_*.pkl")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert not named(run, "unwatched")
    assert_no_process_left(run)
