"""``ftkit export``'s refusals on synthetic checkpoint trees: torn, uncommitted, missing and FSDP checkpoints, bad
options and destinations (exit 2, nothing written, the run directory untouched), refusals that import no heavy
library, size parsing. Real runs exported and proven by logits: tests/integration/export/test_export.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.errors import ExitCode
from tests.helpers.ckpt import commit, flip_byte, make_ckpt, make_dcp_ckpt, staging_left, tree
from tests.helpers.rundir import write_spec
from tests.helpers.runs import ftkit

HEAVY = ("torch", "deepspeed", "transformers", "accelerate", "peft", "safetensors")


def _spec(run: Path, stage: int = 2, precision: str = "fp32") -> None:
    write_spec(run, stage=stage, precision=precision)


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    """A run directory with a committed checkpoint-4 and checkpoint-8 (fake payloads: fine for refusals, which
    happen before any file is read as a tensor)."""
    run = tmp_path / "run"
    for step in (4, 8):
        commit(make_ckpt(run, step, bf16=False))
    _spec(run)
    return run


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return ftkit("export", *args, timeout=120)


def test_torn_checkpoint_is_refused_with_its_reason_and_dir_untouched(synthetic: Path, tmp_path: Path) -> None:
    shard = synthetic / "checkpoint-8" / "global_step8" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip_byte(shard, 100)
    out = tmp_path / "exported"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier export\n")
    before = tree(out)
    r = run_cli(str(synthetic), "--checkpoint", "8", "-o", str(out), "--force")
    assert r.returncode == ExitCode.NO_CHECKPOINT, r.stderr
    assert "checkpoint-8" in r.stderr and "checksum" in r.stderr and "refusing to export" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert tree(out) == before
    assert staging_left(tmp_path) == []
    # a destination that did not exist is not created either
    r = run_cli(str(synthetic), "--checkpoint", "8", "-o", str(tmp_path / "new"))
    assert r.returncode == ExitCode.NO_CHECKPOINT and not (tmp_path / "new").exists()


def test_uncommitted_and_missing_checkpoints_are_refused(synthetic: Path, tmp_path: Path) -> None:
    (synthetic / "checkpoint-8" / "ftkit_commit.json").unlink()
    r = run_cli(str(synthetic), "--checkpoint", "8", "-o", str(tmp_path / "o"))
    assert r.returncode == ExitCode.NO_CHECKPOINT and "no commit record" in r.stderr, r.stderr
    r = run_cli(str(synthetic), "--checkpoint", "16", "-o", str(tmp_path / "o"))
    assert r.returncode == ExitCode.NO_CHECKPOINT and "no checkpoint-16 (checkpoints: 4, 8)" in r.stderr, r.stderr
    r = run_cli(str(synthetic), "--checkpoint", "final", "-o", str(tmp_path / "o"))
    assert r.returncode == ExitCode.NO_CHECKPOINT and "no final/" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_latest_with_nothing_committed_names_the_reason(synthetic: Path, tmp_path: Path) -> None:
    flip_byte(synthetic / "checkpoint-4" / "model.safetensors", 10)
    (synthetic / "checkpoint-8" / "ftkit_commit.json").unlink()
    (synthetic / "final").mkdir()  # a run killed in its final save: final/ without a commit record
    r = run_cli(str(synthetic), "-o", str(tmp_path / "o"))
    assert r.returncode == ExitCode.NO_CHECKPOINT, r.stderr
    assert "no committed checkpoint to export (2 checkpoint-N found); checkpoint-4: model.safetensors checksum" in (
        r.stderr
    )


def test_fsdp_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpt = make_dcp_ckpt(run, 3, world_size=1)
    commit(ckpt, world_size=1, stage=None)
    _spec(run)
    r = run_cli(str(run), "--checkpoint", "3", "-o", str(tmp_path / "o"))
    assert r.returncode == ExitCode.NO_CHECKPOINT and "FSDP2" in r.stderr and "export the run's final/" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--merge-lora", "--adapter"], "--merge-lora and --adapter exclude each other"),
        (["--adapter"], "--adapter: checkpoint-8 is not a LoRA checkpoint"),
        (["--checkpoint", "eight"], "--checkpoint: 'eight' is not a step number"),
        (["--max-shard-size", "5 parsecs"], "--max-shard-size: '5 parsecs' is not a size"),
        (["-o", "{run}/checkpoint-8/inside"], "overlaps checkpoint-8"),
        (["-o", "{run}/checkpoint-99"], "is a name the run itself uses"),
        (["-o", "{run}/final"], "is a name the run itself uses"),
        (["-o", "{tmp}/full"], "exists and is not empty (--force replaces it)"),
        (["-o", "{tmp}/afile"], "exists and is not a directory"),
        # issue 36, item 4: the run's own state, even with --force (it replaced RUN/ftkit, and the run was gone)
        (["-o", "{run}/ftkit", "--force"], "ftkit, the run's own state: an export never goes there"),
        (["-o", "{run}/logs", "--force"], "logs, the run's own state"),
        (["-o", "{run}/logs/attempt-0/x", "--force"], "logs, the run's own state"),
        (["-o", "{run}/events.jsonl", "--force"], "events.jsonl, the run's own state"),
    ],
)
def test_bad_options_and_destinations_exit_2_and_write_nothing(
    synthetic: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "afile").write_text("a file")
    (synthetic / "logs" / "attempt-0").mkdir(parents=True)
    (synthetic / "logs" / "attempt-0" / "rank-0.log").write_text("a log\n")
    (synthetic / "events.jsonl").write_text('{"event": "launch"}\n')
    before = tree(tmp_path)
    argv = [a.format(run=synthetic, tmp=tmp_path) for a in args]
    r = run_cli(str(synthetic), "--checkpoint", "8", *argv)
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert message in r.stderr, r.stderr
    assert tree(tmp_path) == before


def test_run_and_verify_arguments(tmp_path: Path, synthetic: Path) -> None:
    r = run_cli()
    assert r.returncode == ExitCode.USAGE and "missing RUN" in r.stderr
    r = run_cli(str(synthetic), "--verify", str(tmp_path))
    assert r.returncode == ExitCode.USAGE and "not both" in r.stderr
    r = run_cli("--verify", str(tmp_path))
    assert r.returncode == ExitCode.USAGE and "no ftkit_export.json" in r.stderr
    r = run_cli(str(tmp_path / "nope"))
    assert r.returncode == ExitCode.USAGE and "does not exist" in r.stderr
    r = run_cli(str(tmp_path))
    assert r.returncode == ExitCode.USAGE and "not an ftkit run directory" in r.stderr


_PROBE = """
import sys
from ftkit.cli.main import cli
try:
    cli(sys.argv[1:], standalone_mode=False)
except SystemExit:
    pass
except Exception as e:
    print("ERROR", type(e).__name__, e, file=sys.stderr)
print("HEAVY=" + ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("case", ["help", "torn"])
def test_help_and_refusals_import_no_heavy_stack(synthetic: Path, tmp_path: Path, case: str) -> None:
    if case == "torn":
        flip_byte(synthetic / "checkpoint-8" / "latest", 0)
    argv = ["export", "--help"] if case == "help" else ["export", str(synthetic), "--checkpoint", "8"]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY), *argv], capture_output=True, text=True, timeout=60
    )
    heavy = [line for line in out.stderr.splitlines() if line.startswith("HEAVY=")]
    assert heavy == ["HEAVY="], out.stderr[-2000:]
    assert case == "help" or "refusing to export" in out.stderr


def test_sizes() -> None:
    from ftkit.export.weights import parse_size

    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("500kB") == 500_000
    assert parse_size("1.5MB") == 1_500_000
    assert parse_size(123) == 123
    for bad in ("", "GB", "-1GB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_verify_of_an_export_without_its_commit_record_is_torn(tmp_path: Path) -> None:
    """--verify reads the export's files against its commit record first: none there is exit 13, never a crash
    (ftkit.export's own ``verify`` submodule once shadowed the checkpoint verifier it imports)."""
    from ftkit.export import ExportTorn, verify_export
    from ftkit.export.card import RECORD, RECORD_FORMAT

    out = tmp_path / "out"
    out.mkdir()
    (out / RECORD).write_text(json.dumps({"format": RECORD_FORMAT, "source": {"run_dir": str(tmp_path)}}))
    (out / "model.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(ExportTorn) as e:
        verify_export(out)
    assert e.value.exit_code == ExitCode.VERIFY_FAILED


# ---------------------------------------------------------------------------------------------------------------
# A run still training (issue 36, item 14): its rotation deletes checkpoints while an export reads them


def test_a_held_checkpoint_outlives_the_runs_rotation_and_its_hold_is_released(synthetic: Path) -> None:
    from ftkit.checkpoint.directory import rotate
    from ftkit.checkpoint.verify import verify
    from ftkit.export.source import hold, release, resolve

    held = hold(resolve(synthetic, 4))
    assert held.name == "checkpoint-4" and held.path != synthetic / "checkpoint-4"
    assert [p.name for p in rotate(synthetic, 1)] == ["checkpoint-4"]  # the live run's rotation, for real
    assert not (synthetic / "checkpoint-4").exists()
    assert verify(held.path, True, require_commit=True).ok  # every byte still there, as committed
    release(held)
    assert sorted(p.name for p in synthetic.iterdir()) == ["checkpoint-8", "ftkit"]


def test_a_checkpoint_rotated_away_before_it_is_held_is_gone_not_corrupt(
    synthetic: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live run rotates right after the export chose its checkpoint: a step asked for by number is gone (exit
    11, "not damaged"), never "corrupt" (exit 5, what it said before); the newest one is chosen again."""
    import ftkit.export
    from ftkit.checkpoint.directory import rotate
    from ftkit.export import CheckpointGone, _take
    from ftkit.export.source import release, resolve

    def resolve_then_the_run_saves_and_rotates(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        chosen = resolve(*args, **kw)
        if not (synthetic / "checkpoint-12").exists():
            commit(make_ckpt(synthetic, 12, bf16=False))
            rotate(synthetic, 1)
        return chosen

    monkeypatch.setattr(ftkit.export, "resolve", resolve_then_the_run_saves_and_rotates)
    lines: list[str] = []
    with pytest.raises(CheckpointGone, match="checkpoint-8 was deleted by the run's checkpoint rotation") as e:
        _take(synthetic, 8, False, lines.append)
    assert e.value.exit_code == ExitCode.RUN_BUSY and "not damaged" in str(e.value)
    shutil.rmtree(synthetic / "checkpoint-12")
    commit(make_ckpt(synthetic, 8, bf16=False))
    source = _take(synthetic, "latest", False, lines.append)  # 8 chosen, rotated away, 12 chosen and held
    assert source.name == "checkpoint-12" and lines == [
        "checkpoint-8 was rotated away by the live run before it was held: choosing the newest again"
    ]
    release(source)
    assert not list(synthetic.glob(".ftkit-export-hold-*"))
