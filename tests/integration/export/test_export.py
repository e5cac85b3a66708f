"""``ftkit export`` of real 2-rank CPU runs: every checkpoint kind exported, loaded by transformers and proven by logits
against an independent path; a torn real checkpoint, ``--verify`` and a mismatch. The refusals on synthetic trees are
tests/export/test_export.py.

The tests share their runs (one per kind, 2 optimizer steps, a checkpoint at step 2 and final/, made the first
time a test needs it) and the session's ``baseline`` run (ZeRO-2, checkpoints 8 and 12); exports run in this
process, so torch and transformers are imported once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ftkit.errors import ExitCode
from tests.helpers.ckpt import flip_byte, staging_left, tree
from tests.helpers.runs import RUN_ENV, RUN_TIMEOUT_S, assert_no_process_left, ftkit, mp_lock
from tests.helpers.runs import write_recipe as _write_recipe


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return ftkit("export", *args, timeout=120)


LORA = {
    "peft__method": "lora",
    "peft__r": 4,
    "peft__alpha": 8,
    "peft__dropout": 0.0,
    "peft__target_modules": ["q_proj", "v_proj"],
}
CASES: dict[str, dict[str, Any]] = {
    "zero0": {"zero__stage": 0},
    "zero1": {"zero__stage": 1},
    "zero3": {"zero__stage": 3},
    "zero3-offload": {"zero__stage": 3, "zero__offload_params": "cpu", "zero__offload_optimizer": "cpu"},
    "lora": {"zero__stage": 2, **LORA},
}


@pytest.fixture(scope="module")
def run_of(fx: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``run_of(kind)``: the run directory of a 2-step, 2-rank run of that kind (made on first use, then shared)."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            d = tmp_path_factory.mktemp(f"export-{kind}")
            own = {}
            if kind == "lora":  # its own copy of the base model: the test changes it in the end
                shutil.copytree(fx["model"], d / "base")
                own = {"model__path": str(d / "base")}
            recipe = _write_recipe(d, fx, train__max_steps=2, train__save_steps=2, **CASES[kind], **own)
            with mp_lock():
                r = ftkit("launch", str(recipe), env=RUN_ENV, timeout=RUN_TIMEOUT_S)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            assert_no_process_left(d / "run")
            made[kind] = d / "run"
        return made[kind]

    return get


def _export(run: Path, checkpoint: Any, out: Path, **kw: Any) -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ftkit.export import export

    lines: list[str] = []
    result = export(run, checkpoint, out, note=lines.append, **kw)
    result.lines = lines
    return result


def _assert_proven(result: Any, reference: str) -> None:
    v = result.verdict
    assert v is not None and v.ok, v and v.summary()
    judged = [c for c in v.checks if c.tolerance is not None]
    assert judged and all(c.max_abs_diff <= 1e-5 for c in judged), [c.line() for c in v.checks]
    assert any(reference in c.reference for c in judged), [c.reference for c in judged]
    card = (result.path / "README.md").read_text()
    assert "logits check PASSED" in card and result.source.name in card
    rec = json.loads((result.path / "ftkit_export.json").read_text())
    assert rec["verdict"]["ok"] is True and rec["source"]["step"] == result.source.step
    from ftkit.checkpoint.verify import verify

    assert verify(result.path).ok  # the export's own commit record covers every file it wrote


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("kind", "checkpoint", "reference"),
    [
        ("zero0", 2, "DeepSpeed's saved module"),
        ("zero1", 2, "DeepSpeed's zero_to_fp32"),
        ("zero3", 2, "DeepSpeed's zero_to_fp32"),
        ("zero3", "final", "live trained model"),
        ("zero3-offload", 2, "DeepSpeed's zero_to_fp32"),
    ],
)
def test_full_fine_tuning_exports_prove_their_logits(
    run_of: Any, tmp_path: Path, kind: str, checkpoint: Any, reference: str
) -> None:
    run = run_of(kind)
    result = _export(run, checkpoint, tmp_path / "out")
    _assert_proven(result, reference)
    assert result.kind == "full" and result.dtype == "fp32"
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= {
        p.name for p in result.path.iterdir()
    }
    if checkpoint == "final":  # also against HF's own loading of final/
        assert any("from_pretrained of final" in c.reference for c in result.verdict.checks)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero2_checkpoints_latest_sharded_bf16_and_hf_files(baseline: dict, tmp_path: Path) -> None:
    """The baseline run (ZeRO-2): every committed checkpoint, sharded output with the index, a bf16 export, and the
    export's logits against HF Trainer's own model.safetensors of the same checkpoint (a third path)."""
    import torch
    from transformers import AutoModelForCausalLM

    run = baseline["run"]
    r8 = _export(run, 8, tmp_path / "c8")
    _assert_proven(r8, "DeepSpeed's zero_to_fp32 of checkpoint-8/global_step8")
    latest = _export(run, "latest", tmp_path / "latest", max_shard_size="100kB")
    _assert_proven(latest, "zero_to_fp32 of checkpoint-12")
    index = json.loads((latest.path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in latest.path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    bf16 = _export(run, 12, tmp_path / "bf16", dtype="bf16")
    _assert_proven(bf16, "rounded to bf16")
    assert json.loads((bf16.path / "config.json").read_text())["dtype"] == "bfloat16"
    assert any(c.tolerance is None and c.max_abs_diff > 0 for c in bf16.verdict.checks)  # rounding, reported

    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    ours = AutoModelForCausalLM.from_pretrained(str(latest.path), dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(str(run / "checkpoint-12"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert float((ours(ids).logits - hf(ids).logits).abs().max()) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_merged_and_adapter(run_of: Any, tmp_path: Path) -> None:
    from safetensors import safe_open

    run = run_of("lora")
    merged = _export(run, 2, tmp_path / "merged")  # the default for a LoRA run
    assert merged.kind == "merged" and any("merging the adapter" in line for line in merged.lines)
    _assert_proven(merged, "PEFT's merge_and_unload() of checkpoint-2's adapter")
    adapter = _export(run, 2, tmp_path / "adapter", lora="adapter")
    _assert_proven(adapter, "PEFT's PeftModel.from_pretrained(base, checkpoint-2)")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.path.iterdir()}
    with (
        safe_open(str(adapter.path / "adapter_model.safetensors"), "pt") as ours,
        safe_open(str(run / "checkpoint-2" / "adapter_model.safetensors"), "pt") as peft,
    ):
        assert sorted(ours.keys()) == sorted(peft.keys())  # PEFT's own names
    final = _export(run, "final", tmp_path / "final")
    _assert_proven(final, "live trained model")

    # Issue 36, item 7: the base model changed after training, same size (one weight of the last tensor): the merge
    # went into the wrong base, its own logits check passed (both sides read that base) and it exited 0.
    from ftkit.export import ExportRefused

    base = run.parent / "base" / "model.safetensors"
    size = base.stat().st_size
    with open(base, "r+b") as fh:
        fh.seek(size - 4)
        old = fh.read(4)
        fh.seek(size - 4)
        fh.write(bytes([old[0] ^ 0x01, *old[1:]]))  # the lowest mantissa bit of a float32
    assert base.stat().st_size == size
    with pytest.raises(ExportRefused, match="model.safetensors: same size, other content .* the base model changed"):
        _export(run, 2, tmp_path / "changed")
    assert not (tmp_path / "changed").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_universal_checkpoint_of_a_shrink(baseline: dict, tmp_path: Path) -> None:
    """What a shrink leaves: ftkit's own ds_to_universal conversion beside a committed 2-rank checkpoint."""
    from ftkit.supervise.universal import convert_to_universal

    run = tmp_path / "run"
    shutil.copytree(baseline["run"], run, symlinks=True)
    convert_to_universal(run / "checkpoint-12", "global_step12", env=RUN_ENV)
    result = _export(run, 12, tmp_path / "out", universal=True)
    assert result.source.layout == "universal"
    _assert_proven(result, "DeepSpeed's zero_to_fp32 of checkpoint-12/global_step12")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_export_reads_on_while_the_live_runs_rotation_deletes_its_checkpoint(baseline: dict, tmp_path: Path) -> None:
    """Issue 36, item 14: exporting a run still training failed 4 of 4 times with "no model states file" and read
    as corruption (exit 5): its rotation deleted the checkpoint mid-export. The export holds it (hard links) before
    it writes anything, so the rotation, run for real the moment the export begins writing, takes nothing from it."""
    import threading

    from ftkit.checkpoint.directory import rotate

    run = tmp_path / "run"
    shutil.copytree(baseline["run"], run, symlinks=True)
    rotated: list[Path] = []

    def the_run_rotates_once_the_export_writes() -> None:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".out.ftkit-export-*")) and time.monotonic() < deadline:
            time.sleep(0.005)
        rotated.extend(rotate(run, 1))  # keeps checkpoint-12

    rotation = threading.Thread(target=the_run_rotates_once_the_export_writes)
    rotation.start()
    try:
        result = _export(run, 8, tmp_path / "out")
    finally:
        rotation.join()
    assert [p.name for p in rotated] == ["checkpoint-8"] and not (run / "checkpoint-8").exists()
    _assert_proven(result, "DeepSpeed's zero_to_fp32 of checkpoint-8/global_step8")
    assert result.source.path == run / "checkpoint-8" and not list(run.glob(".ftkit-export-hold-*"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torn_real_checkpoint_cli_verify_and_mismatch(baseline: dict, tmp_path: Path) -> None:
    """A torn checkpoint-12 is refused (exit 5, DIR untouched) and latest skips it; --verify re-checks an export,
    a changed byte is exit 13, changed weights (re-committed) exit 15."""
    run = tmp_path / "run"
    shutil.copytree(baseline["run"], run, symlinks=True)
    flip_byte(run / "checkpoint-12" / "global_step12" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 4096)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("keep me")
    before = tree(out)
    r = run_cli(str(run), "--checkpoint", "12", "-o", str(out), "--force")
    assert r.returncode == ExitCode.NO_CHECKPOINT, r.stderr
    assert "checkpoint-12: global_step12/zero_pp_rank_0_mp_rank_00_optim_states.pt checksum" in r.stderr
    assert tree(out) == before and staging_left(tmp_path) == []

    latest = _export(run, "latest", out, force=True)  # replaces DIR atomically
    assert latest.source.name == "checkpoint-8" and latest.lines[0].startswith("skipped: checkpoint-12: ")
    assert not (out / "old").exists() and (out / "model.safetensors").is_file() and staging_left(tmp_path) == []
    from ftkit.export import verify_export

    assert verify_export(out).ok

    _tamper_weights(out, recommit=False)
    r = run_cli("--verify", str(out))
    assert r.returncode == ExitCode.VERIFY_FAILED and "model.safetensors" in r.stderr, r.stderr
    _tamper_weights(out, recommit=True)
    r = run_cli("--verify", str(out))
    assert r.returncode == ExitCode.EXPORT_MISMATCH and "logits check FAILED" in r.stderr, r.stdout + r.stderr


def _tamper_weights(export_dir: Path, *, recommit: bool) -> None:
    """Add 0.01 to one weight of the export (rewritten as safetensors); ``recommit``: write a fresh commit record,
    as if the export itself had been written that way."""
    import torch
    from safetensors.torch import load_file, save_file

    from ftkit.checkpoint.commit import manifest_part, write_commit
    from ftkit.checkpoint.layout import read_commit

    path = export_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + torch.full_like(tensors["model.norm.weight"], 0.01)
    save_file(tensors, str(path), metadata={"format": "pt"})
    if recommit:
        old = read_commit(export_dir)
        assert old is not None
        (export_dir / "ftkit_commit.json").unlink()
        write_commit(
            export_dir,
            [manifest_part(export_dir, 0, 1)],
            step=old["step"],
            world_size=old["world_size"],
            stage=old["stage"],
            recipe_hash=old["recipe_hash"],
            kind="model",
            extra=old["extra"],
        )
