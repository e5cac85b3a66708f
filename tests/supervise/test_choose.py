"""Where an attempt resumes from (``ftkit.supervise.choose.select``), on synthetic checkpoints (real commit records,
real verification): above all the refusal that keeps a run's only progress from being overwritten (issue 41 point 3:
deleting it passed every test)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ftkit.checkpoint.directory import record_save_begun
from ftkit.errors import ExitCode
from ftkit.rundir.layout import RunDir
from ftkit.supervise.choose import select
from tests.helpers.ckpt import commit, flip_byte, make_ckpt, tree
from tests.helpers.cli import run_ftkit

REFUSAL = (
    "no checkpoint verifies (reasons above) and some were complete once: refusing to start over and overwrite "
    "them; move them away or use a new train.output_dir"
)


def _committed(run: Path, *steps: int) -> list[Path]:
    out = []
    for s in steps:
        out.append(make_ckpt(run, s))
        commit(out[-1])
    return out


def _damage(ckpt: Path) -> None:
    flip_byte(ckpt / "model.safetensors", 10)


def _select(run: Path):
    return select(RunDir(run), checksums=True, world_size=2, stage=2, max_steps=None)


def test_committed_checkpoints_that_no_longer_verify_refuse_a_fresh_start(tmp_path):
    run = tmp_path / "run"
    for ckpt in _committed(run, 4, 8):
        _damage(ckpt)
    choice = _select(run)
    assert choice.exit_code == ExitCode.NO_CHECKPOINT and choice.refusal == REFUSAL, choice
    assert choice.resume is None
    assert [v.step for v in choice.selection.rejected] == [8, 4]  # both named (the "reasons above")


def test_one_committed_checkpoint_that_verifies_is_resumed_from(tmp_path):
    run = tmp_path / "run"
    _, newest = _committed(run, 4, 8)
    _damage(newest)
    choice = _select(run)
    assert choice.exit_code is None and choice.step == 4 and choice.resume == str(run / "checkpoint-4"), choice
    assert [v.step for v in choice.selection.rejected] == [8]


def test_only_torn_saves_start_fresh(tmp_path):
    """A save ftkit began but never committed was never complete: nothing to protect, the run starts over."""
    run = tmp_path / "run"
    for step in (4, 8):
        make_ckpt(run, step)
        record_save_begun(run, step, attempt=0)
    choice = _select(run)
    assert choice.exit_code is None and choice.resume is None and choice.refusal is None, choice
    assert {v.kind for v in choice.selection.rejected} == {"no_commit"}


def test_launch_refuses_with_its_message_and_touches_nothing(tmp_path, model_dir):
    """The command line: ``ftkit launch --dry-run`` exits as the launch would (5), says why, and the damaged
    checkpoints are left as they were."""
    (tmp_path / "data.jsonl").write_text('{"text": "hello world"}\n')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(
            """\
            model: {path: ./model}
            data: {train: ./data.jsonl}
            train: {output_dir: ./run, micro_batch_size: 2, global_batch_size: 16}
            zero: {stage: 2}
            cluster: {gpus_per_node: 2, accelerator: cpu}
            """
        )
    )
    run = tmp_path / "run"
    for ckpt in _committed(run, 4, 8):
        _damage(ckpt)
    before = tree(run)
    r = run_ftkit("launch", str(recipe), "--dry-run", cwd=tmp_path)
    assert r.returncode == ExitCode.NO_CHECKPOINT, r.stdout + r.stderr
    assert f"ftkit: error: {REFUSAL}" in r.stdout, r.stdout
    assert r.stdout.count("ftkit: would skip checkpoint-") == 2, r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    assert tree(run) == before


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_checkpoint_past_max_steps_refuses_only_when_it_verifies(tmp_path, corrupt):
    run = tmp_path / "run"
    (ckpt,) = _committed(run, 8)
    if corrupt:
        _damage(ckpt)
    choice = select(RunDir(run), checksums=True, world_size=2, stage=2, max_steps=6)
    if corrupt:
        assert choice.exit_code == ExitCode.NO_CHECKPOINT and choice.refusal == REFUSAL
    else:
        assert choice.exit_code == ExitCode.USAGE and "checkpoint-8 is past train.max_steps=6" in (choice.refusal or "")


def test_a_checkpoint_of_another_world_size_is_refused_by_name_not_as_unverifiable(tmp_path):
    """Intact checkpoints committed by 2 ranks, a launch with 4: the refusal says why (the world size) and what to
    do (the original cluster, or let ftkit convert on a shrink), not the catch-all "no checkpoint verifies"; after a
    shrink that ftkit runs itself the newest is converted."""
    run = tmp_path / "run"
    _committed(run, 4, 8)
    choice = select(RunDir(run), checksums=True, world_size=4, stage=2, max_steps=None)
    assert choice.exit_code == ExitCode.NO_CHECKPOINT and choice.resume is None, choice
    assert choice.refusal.startswith("checkpoint-8: committed with world size 2, this launch has 4"), choice.refusal
    assert "launch with the original cluster" in choice.refusal
    shrink = select(RunDir(run), checksums=True, world_size=4, stage=2, max_steps=None, convert_from_world=2)
    assert shrink.convert and shrink.exit_code is None and shrink.selection.incompatible[0].step == 8, shrink
