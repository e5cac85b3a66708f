"""The resume fingerprint (ftkit.run.fingerprint): what is recorded, and what a resume does with each difference."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ftkit.errors import ExitCode, UserError
from ftkit.plan.plan import build_plan
from ftkit.recipe.load import load_recipe
from ftkit.recipe.schema import FIELD_BY_KEY
from ftkit.run.fingerprint import POLICY, ResumeRefused, compare, compute, policy
from ftkit.rundir.spec import RANK_APPLIED

RECIPE = """\
model:
  path: ./model
data:
  train: ./data.jsonl
train:
  output_dir: ./run
  precision: fp32
  micro_batch_size: 2
  global_batch_size: 16
  learning_rate: 0.0002
cluster:
  gpus_per_node: 8
"""


@pytest.fixture
def setup(tmp_path: Path, write_recipe, model_dir: Path):  # noqa: ARG001
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"example {i} " * 8}) + "\n" for i in range(50)))
    (model_dir / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (model_dir / "model.safetensors").write_bytes(b"\0" * 1000)
    recipe = write_recipe(RECIPE)

    def fp(*overrides: str) -> dict:
        return compute(build_plan(load_recipe(recipe, list(overrides)), with_memory=False))

    return fp, data, model_dir


def test_compute_records_recipe_data_model_tokenizer_versions(setup):
    fp, data, model_dir = setup
    f = fp()
    json.dumps(f)  # JSON-able: it goes into spec.json and every commit record
    assert f["recipe"]["train.learning_rate"] == 0.0002
    assert f["data"]["size"] == data.stat().st_size and len(f["data"]["xxh3_128"]) == 32
    assert f["model"]["config_xxh3_128"] and f["model"]["weights"] == {"model.safetensors": 1000}
    assert f["model"]["weights_xxh3_128"]["model.safetensors"].startswith("xxh3_128:")
    assert f["tokenizer"]["xxh3_128"]
    assert f["versions"]["ftkit"] and "torch" in f["versions"]
    again = fp()
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in f.items() if k != "seconds"}


def test_compute_imports_no_heavy_library(tmp_path: Path):
    import subprocess

    code = (
        "import sys, ftkit.run.fingerprint as f; f.versions(); "
        "print(sorted({'torch', 'deepspeed', 'transformers', 'peft', 'accelerate'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_identical_is_clean(setup):
    fp, _, _ = setup
    check = compare(fp(), fp(), ())
    assert check.ok and check.applied == [] and check.refused == [] and check.lines() == []


def test_safe_changes_apply_and_are_listed(setup):
    fp, _, _ = setup
    check = compare(
        fp(),
        fp("train.max_steps=200", "train.save_steps=5", "resilience.hang_timeout_s=30", "cluster.master_port=29999"),
        (),
    )
    assert check.ok
    assert {c.key for c in check.applied} == {
        "train.max_steps",
        "train.save_steps",
        "resilience.hang_timeout_s",
        "cluster.master_port",
    }
    assert all(c.verdict == "safe" for c in check.applied)
    assert "train.max_steps: 100 → 200 (applied: step limit)" in check.lines()
    assert check.overrides() == {}  # nothing for the rank to re-apply


def test_unsafe_change_is_refused_with_the_flag_to_pass(setup):
    fp, _, _ = setup
    check = compare(fp(), fp("train.learning_rate=0.0001"), ())
    assert not check.ok
    assert check.lines() == [
        "train.learning_rate: 0.0002 → 0.0001 (refused: changes the optimizer; "
        "pass --allow-changes train.learning_rate to apply it)"
    ]
    with pytest.raises(ResumeRefused) as e:
        check.raise_if_refused()
    assert e.value.exit_code == ExitCode.USAGE and e.value.lines() == check.lines()


def test_allowed_change_is_applied_and_handed_to_the_rank(setup):
    fp, _, _ = setup
    check = compare(fp(), fp("train.learning_rate=0.0001", "train.max_steps=8"), ["train.learning_rate"])
    assert check.ok
    verdicts = {c.key: c.verdict for c in check.applied}
    assert verdicts == {"train.learning_rate": "allowed", "train.max_steps": "safe"}
    assert check.overrides() == {"train.learning_rate": 0.0001}
    assert "train.learning_rate" in RANK_APPLIED


def test_impossible_change_is_refused_even_when_allowed(setup):
    fp, _, _ = setup
    check = compare(fp(), fp("train.seed=7"), ["train.seed"])
    assert [c.verdict for c in check.refused] == ["impossible"]
    assert check.lines()[0].startswith("train.seed: 42 → 7 (refused, cannot be applied to a resumed run: data order")


def test_unknown_allow_key_is_a_user_error_naming_it(setup):
    fp, _, _ = setup
    with pytest.raises(UserError) as e:
        compare(fp(), fp(), ["train.learnig_rate", "train.seed"])
    msg = "\n".join(e.value.lines())
    assert "train.learnig_rate" in msg and "did you mean 'train.learning_rate'" in msg
    assert "--allow-changes" in msg


def test_same_size_data_content_change_is_refused_naming_the_file(setup):
    fp, data, _ = setup
    before = fp()
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit, same size
    data.write_bytes(bytes(raw))
    check = compare(before, fp(), ())
    size = data.stat().st_size
    assert check.lines() == [
        f"data.train: content changed ({data}, {size} → {size} bytes) "
        "(refused: changes the training examples; pass --allow-changes data.train to apply it)"
    ]
    assert compare(before, fp(), ["data.train"]).ok


def test_moved_data_with_same_content_is_safe(setup, tmp_path: Path):
    fp, data, _ = setup
    before = fp()
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(data.read_bytes())
    check = compare(before, fp(f"data.train={copy}"), ())
    assert check.ok and [c.key for c in check.applied] == ["data.train"]
    assert "moved, same content" in check.lines()[0]


def test_model_config_change_cannot_be_resumed(setup):
    fp, _, model_dir = setup
    before = fp()
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rope_theta"] = 5000.0
    (model_dir / "config.json").write_text(json.dumps(cfg))
    check = compare(before, fp(), ["model.path"])
    assert [(c.key, c.verdict) for c in check.refused] == [("model.path", "impossible")]
    assert "config.json changed" in check.lines()[0]


def test_same_size_base_weights_change_cannot_be_resumed_and_is_found_by_content(setup, monkeypatch):
    """Issue 36, item 7: the fingerprint recorded the weights' sizes only; base weights edited in place (same size)
    passed. Their checksums are the commit record's (XXH3-128 of every byte); an unchanged file keeps the checksum
    the run's last launch recorded (its stat, ctime included, unchanged) instead of being read again."""
    from ftkit.checkpoint.checksums import full_checksum
    from ftkit.run import fingerprint
    from ftkit.run.fingerprint import changed_weights

    fp, _, model_dir = setup
    weights = model_dir / "model.safetensors"
    before = fp()
    assert before["model"]["weights_xxh3_128"] == {"model.safetensors": full_checksum(weights)}
    assert changed_weights(model_dir, before["model"]) == []
    with open(weights, "r+b") as fh:  # one byte of a weight, the size unchanged
        fh.seek(700)
        fh.write(b"\x01")
    after = fp()
    assert after["model"]["weights"] == before["model"]["weights"]
    check = compare(before, after, ["model.path"])
    assert [(c.key, c.verdict) for c in check.refused] == [("model.path", "impossible")]
    assert "weight files changed" in check.lines()[0]
    assert changed_weights(model_dir, before["model"]) == [
        f"{weights}: same size, other content ({before['model']['weights_xxh3_128']['model.safetensors']} when the "
        "run trained on it)"
    ]
    # an older ftkit's record has sizes only: compared by size, never refused for a missing checksum
    old = json.loads(json.dumps(before))
    del old["model"]["weights_xxh3_128"], old["model"]["weights_stat"]
    assert compare(old, after, ()).ok and changed_weights(model_dir, old["model"]) == []
    # the next launch of the run reads no weight again while the file is unchanged
    spec = model_dir.parent / "run" / "ftkit" / "spec.json"
    spec.parent.mkdir(parents=True)
    spec.write_text(json.dumps({"fingerprint": after}))
    read: list[Path] = []
    monkeypatch.setattr(fingerprint, "full_checksum", lambda p: read.append(p) or full_checksum(p))
    assert fp()["model"]["weights_xxh3_128"] == after["model"]["weights_xxh3_128"] and read == []
    weights.touch()  # a new mtime and ctime: read again
    assert fp()["model"]["weights_xxh3_128"] == after["model"]["weights_xxh3_128"] and read == [weights]


def test_tokenizer_change_is_refused_unless_allowed(setup):
    fp, _, model_dir = setup
    before = fp()
    (model_dir / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    assert [c.key for c in compare(before, fp(), ()).refused] == ["model.tokenizer"]
    assert compare(before, fp(), ["model.tokenizer"]).ok


def test_missing_recorded_fingerprint_is_one_note_nothing_refused(setup):
    fp, _, _ = setup
    check = compare(None, fp("train.learning_rate=0.0001"), ())
    assert check.ok and check.applied == [] and len(check.notes) == 1
    assert "no fingerprint" in check.notes[0]


def test_version_change_is_a_note_not_a_refusal(setup):
    fp, _, _ = setup
    old = fp()
    old["versions"]["transformers"] = "4.0.0"
    check = compare(old, fp(), ())
    assert check.ok and check.lines() == []
    assert any(n.startswith("transformers 4.0.0 → ") for n in check.notes)


def test_key_missing_from_an_older_record_is_a_note(setup):
    fp, _, _ = setup
    old = fp()
    del old["recipe"]["train.warmup_steps"]
    check = compare(old, fp(), ())
    assert check.ok and any("train.warmup_steps: not recorded" in n for n in check.notes)


def test_job_shape_is_left_to_checkpoint_selection(setup):
    fp, _, _ = setup
    check = compare(fp(), fp("cluster.gpus_per_node=4", "zero.stage=1"), ())
    assert check.ok and check.lines() == []


def test_policy_table_covers_every_recipe_key_deliberately():
    """Every recipe key is either in the table or falls to the default (refuse unless allowed) on purpose."""
    patterns = [p for _, ps, _ in POLICY for p in ps]
    unclassified = [k for k in FIELD_BY_KEY if policy(k)[1] == "not known to be safe"]
    assert unclassified == [], f"classify these keys in ftkit.run.fingerprint.POLICY: {unclassified}"
    assert len(patterns) == len(set(patterns))
    assert set(RANK_APPLIED) <= set(FIELD_BY_KEY)


def test_compute_is_cheap(setup):
    fp, _, _ = setup
    t0 = time.perf_counter()
    f = fp()
    assert f["seconds"] < 0.5 and time.perf_counter() - t0 < 5


# ------------------------------------------------------------------------------------------- the rank side


def _resumed(lr: float, state: dict | None, *, steps: int = 8, warmup: int = 2):
    """An AdamW + HF cosine schedule as the Trainer builds them from TrainingArguments(learning_rate=lr), with a
    checkpoint's optimizer and scheduler state loaded into them the way DeepSpeed/HF do on resume."""
    import torch
    from transformers import get_scheduler

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=warmup, num_training_steps=steps)
    if state is not None:
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    return w, opt, sched


def _train(w, opt, sched, n: int) -> None:
    for _ in range(n):
        (w**2).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.slow  # seconds of CPU: kept out of make test-fast (under a minute on 2 cores)
def test_rank_applies_new_optimizer_values_after_the_checkpoint_is_loaded():
    pytest.importorskip("torch")
    import math

    from ftkit.launch.callback import apply_resume_overrides

    w, opt, sched = _resumed(1e-3, None)
    _train(w, opt, sched, 4)
    ckpt = {"opt": opt.state_dict(), "sched": sched.state_dict()}

    # The defect: a new learning rate in TrainingArguments alone is overwritten by the checkpoint's state.
    _, opt2, sched2 = _resumed(5e-4, ckpt)
    assert sched2.base_lrs == [1e-3] and opt2.param_groups[0]["initial_lr"] == 1e-3

    overrides = {
        "train.learning_rate": 5e-4,
        "train.weight_decay": 0.1,
        "train.adam_beta2": 0.95,
        "train.adam_epsilon": 1e-6,
        "data.max_seq_len": 64,
    }
    lines = apply_resume_overrides(overrides, opt2, sched2)
    assert len(lines) == 5 and lines[-1] == "data.max_seq_len: 64 (applied through the new spec)"

    def cosine(step: int, warmup: int = 2, total: int = 8) -> float:
        if step < warmup:
            return step / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    g = opt2.param_groups[0]
    assert g["lr"] == pytest.approx(5e-4 * cosine(4)) and sched2.get_last_lr() == [g["lr"]]
    assert g["weight_decay"] == 0.1 and g["betas"] == (0.9, 0.95) and g["eps"] == 1e-6
    for step in range(5, 8):  # and the schedule goes on from the new peak
        _train(w, opt2, sched2, 1)
        assert sched2.get_last_lr()[0] == pytest.approx(5e-4 * cosine(step))
