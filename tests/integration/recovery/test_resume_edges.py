"""The edges of resuming, with the real CLI on copies of the session's uninterrupted run (``baseline``): checkpoints
ftkit did not write, a checkpoint at ``train.max_steps``, a finished run, and ``--dry-run`` exiting as the launch.
"""

from __future__ import annotations

import filecmp
import json
import shutil
from pathlib import Path

import pytest

from ftkit.checkpoint.layout import COMMIT_FILE
from ftkit.errors import ExitCode
from ftkit.rundir.owner import Owner
from tests.helpers.runs import (
    RUN_ENV,
    RUN_STEPS,
    assert_no_process_left,
    ftkit,
    losses,
    mp_lock,
    named,
    recipe_and_run,
)

pytestmark = pytest.mark.slow


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error(r) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("ftkit: error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


@pytest.mark.timeout(300)
def test_checkpoints_ftkit_did_not_write_are_refused_and_left_byte_for_byte(fx, baseline, tmp_path):
    """train.output_dir pointing at a plain HF Trainer run used to call its checkpoints torn, move them aside, train
    from step 1 and then rotate them (a user's file with them) away, exit 0."""
    recipe, run = recipe_and_run(tmp_path, fx)
    run.mkdir()
    for step in (8, 12):
        shutil.copytree(baseline["run"] / f"checkpoint-{step}", run / f"checkpoint-{step}")
        (run / f"checkpoint-{step}" / COMMIT_FILE).unlink()
    (run / "checkpoint-8" / "my-notes.txt").write_text("an evaluation I ran by hand")
    before = _tree(run)
    for args in (["--dry-run"], []):
        with mp_lock():
            r = ftkit("launch", str(recipe), *args, env=RUN_ENV, timeout=120)
        assert r.returncode == ExitCode.USAGE, (args, r.stdout, r.stderr)
        line = _one_error(r)
        assert "checkpoint-8, checkpoint-12, which ftkit did not write" in line and "train.output_dir" in line
        assert _tree(run) == before  # nothing moved, renamed, deleted or added
    assert not named(run, "spawn")


@pytest.mark.timeout(600)
def test_a_checkpoint_at_max_steps_becomes_final_without_a_step_more(fx, baseline, tmp_path):
    """A resume from a checkpoint at max_steps (a crash in the final save, or final/ removed) used to train step
    13 of 12, commit checkpoint-13 and a final/ that differed from the uninterrupted run's."""
    recipe, run = recipe_and_run(tmp_path, fx)
    shutil.copytree(baseline["run"], run, symlinks=True)
    shutil.rmtree(run / "final")
    with mp_lock():
        r = ftkit("launch", str(recipe), env=RUN_ENV, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "it is train.max_steps, so the ranks write final/ from it without training" in r.stdout, r.stdout
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(int(m["step"]) for m in rows if "step" in m) == RUN_STEPS, "a step beyond train.max_steps"
    assert not [m for m in rows if m.get("attempt") == 1 and "loss" in m]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-8"]
    ours, theirs = run / "final", baseline["run"] / "final"
    weights = sorted(p.name for p in theirs.iterdir() if p.suffix == ".safetensors")
    assert weights and filecmp.cmpfiles(theirs, ours, weights, shallow=False)[0] == weights
    probe = json.loads((run / "ftkit" / "probe.json").read_text())
    assert probe == json.loads((baseline["run"] / "ftkit" / "probe.json").read_text())
    assert losses(run) == baseline["losses"]
    status = ftkit("status", str(run), timeout=60)
    assert f"{RUN_STEPS}/{RUN_STEPS}" in status.stdout and f"{RUN_STEPS + 1}/" not in status.stdout, status.stdout
    assert_no_process_left(run)


@pytest.mark.timeout(300)
def test_relaunching_a_finished_run_starts_nothing_and_dry_run_exits_as_launch(fx, baseline, tmp_path):
    """Relaunching a finished run used to spawn a whole attempt; --dry-run exited 0 for launches that would be
    refused."""
    recipe, run = recipe_and_run(tmp_path, fx)
    shutil.copytree(baseline["run"], run, symlinks=True)
    spawns = len(named(run, "spawn"))
    for args in (["--dry-run"], []):
        with mp_lock():
            r = ftkit("launch", str(recipe), *args, env=RUN_ENV, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "the run is already finished (final/ committed at step 12" in r.stdout, r.stdout
    assert len(named(run, "spawn")) == spawns and named(run, "finished")
    # A raised limit is not finished: the dry run says where the launch would resume.
    r = ftkit("launch", str(recipe), "train.max_steps=16", "--dry-run", env=RUN_ENV, timeout=120)
    assert r.returncode == 0 and "a launch now resumes from checkpoint-12" in r.stdout, r.stdout
    # Refusals, with the launch's own exit codes: past max_steps, another ZeRO stage, a live owner.
    r = ftkit("launch", str(recipe), "train.max_steps=10", "--dry-run", env=RUN_ENV, timeout=120)
    assert r.returncode == ExitCode.USAGE and "checkpoint-12 is past train.max_steps=10" in r.stdout, r.stdout
    r = ftkit("launch", str(recipe), "zero.stage=3", "--dry-run", env=RUN_ENV, timeout=120)
    assert r.returncode == ExitCode.NO_CHECKPOINT and "this launch uses stage 3" in r.stdout, r.stdout
    (run / "ftkit" / "owner.json").write_text(Owner.me().to_json())  # this test's own process: alive
    r = ftkit("launch", str(recipe), "--dry-run", env=RUN_ENV, timeout=120)
    assert r.returncode == ExitCode.RUN_BUSY and "a launch now would be refused" in r.stdout, r.stdout
