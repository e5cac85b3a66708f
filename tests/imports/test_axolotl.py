"""Axolotl sources (issue 36): a key the file leaves out takes Axolotl's own default (its config schema,
axolotl/utils/schemas/training.py and config.py, and its trainer builder), not TrainingArguments'; a preference
objective (``rl: dpo``) and tensor/sequence parallelism are refused as documented, not passed as unknown keys that
``--accept`` lets through."""

from __future__ import annotations

import pytest

from ftkit.plan.load import load_and_plan
from tests.imports.helpers import FIX, cli, import_to


@pytest.fixture
def here(monkeypatch):
    monkeypatch.chdir(FIX)
    return FIX


def test_missing_keys_take_axolotls_defaults_not_hfs(here, tmp_path, model_dir):
    """Before: micro batch 8, 3 epochs, a linear schedule (TrainingArguments' defaults)."""
    result, out = import_to(tmp_path, model_dir, "axolotl_defaults.yml")
    r = load_and_plan(str(out), ["cluster.gpus_per_node=2"]).recipe
    assert (r["train.micro_batch_size"], r["train.lr_scheduler"], r["train.max_steps"]) == (1, "cosine", 200)
    assert r["train.global_batch_size"] == 1 * 1 * 8  # accumulation 1, ftkit's default world of 8 (reported)
    assert r["data.max_seq_len"] == 512 and r["train.precision"] == "bf16"
    # Axolotl's default warm-up: 3% of the run's steps, at most 100 (its trainer builder)
    assert r["train.warmup_steps"] == 6
    for key in ("micro_batch_size", "gradient_accumulation_steps", "lr_scheduler", "optimizer", "warmup_steps"):
        assert any(x.startswith(f"axolotl_defaults.yml {key} (absent):") and "Axolotl's default" in x
                   for x in result.lines), (key, result.lines)  # fmt: skip
    # without max_steps, num_epochs defaults to 1 (not 3)
    text = (FIX / "axolotl_defaults.yml").read_text().replace("max_steps: 200\n", "warmup_steps: 5\n")
    (tmp_path / "epochs.yml").write_text(text)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "x"}\n')
    _, out = import_to(tmp_path, model_dir, str(tmp_path / "epochs.yml"))
    r = load_and_plan(str(out), []).recipe
    assert (r["train.epochs"], r["train.max_steps"], r["train.warmup_steps"]) == (1.0, None, 5)


def test_axolotls_default_warmup_cannot_be_counted_for_a_run_in_epochs(here, tmp_path, model_dir):
    text = (FIX / "axolotl_defaults.yml").read_text().replace("max_steps: 200\n", "")
    (tmp_path / "epochs.yml").write_text(text)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "x"}\n')
    r = cli("import", str(tmp_path / "epochs.yml"), "-o", str(tmp_path / "r.yaml"), "--model", str(model_dir))
    assert r.exit_code == 2, r.output
    assert "epochs.yml warmup_steps: Axolotl's default warm-up is 3% of the run's" in r.output, r.output
    r = cli("import", str(tmp_path / "epochs.yml"), "-o", str(tmp_path / "r.yaml"), "--model", str(model_dir),
            "--accept", "warmup_steps")  # fmt: skip
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    "fixture,keys",
    [
        ("axolotl_dpo.yml", ["rl", "rl_beta"]),
        ("axolotl_tp_sp.yml", ["tensor_parallel_size", "context_parallel_size", "sequence_parallel_degree"]),
    ],
)
def test_preference_objectives_and_tensor_or_sequence_parallelism_are_refused_not_unknown(here, tmp_path, fixture,
                                                                                           keys):  # fmt: skip
    """Before: "unknown Axolotl key", which --accept let through (a DPO config then trained as SFT)."""
    out = tmp_path / "r.yaml"
    r = cli("import", fixture, "-o", str(out), "--accept", ",".join(keys))
    assert r.exit_code == 2 and not out.exists(), r.output
    errors = [x.removeprefix("ftkit: error: ") for x in r.output.splitlines() if x.startswith("ftkit: error: ")]
    for key in keys[:1] if fixture == "axolotl_dpo.yml" else keys:
        line = next((x for x in errors if x.startswith(f"{fixture}:") and f" {key}: " in x), None)
        assert line is not None, (key, r.output)
        assert "unknown" not in line and "--accept" not in line, line
