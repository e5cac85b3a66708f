"""``ftkit check --against`` agrees with ``ftkit import`` (issue 36, item 9): the file ``accelerate config`` writes
checks clean against the recipe imported from it; a key the import reports as not carried (same update) is a note in
check, never a difference; ``prescale_gradients: true`` is not DeepSpeed's default."""

from __future__ import annotations

import pytest

from tests.imports.helpers import FIX, cli, import_to


@pytest.fixture
def here(monkeypatch):
    monkeypatch.chdir(FIX)
    return FIX


def test_the_yaml_accelerate_config_writes_checks_clean_against_its_import(here, tmp_path, model_dir):
    """DeepSpeed plugin, bf16: imported, then `check --against` the same file exited 1 (mixed_precision "only in
    the file": compared with accelerate.yaml, where ftkit never writes it under DeepSpeed)."""
    _, out = import_to(tmp_path, model_dir, "accelerate_config_ds_bf16.yaml")
    r = cli("check", str(out), "--against", "accelerate_config_ds_bf16.yaml")
    assert r.exit_code == 0, r.output
    assert "accelerate_config_ds_bf16.yaml: equivalent to what the recipe renders" in r.output
    # a real difference still counts: the recipe trains in fp16 while the file says bf16
    bad = cli("check", str(out), "train.precision=fp16", "--against", "accelerate_config_ds_bf16.yaml")
    assert bad.exit_code == 1 and "mixed_precision" in bad.output, bad.output


def test_prescale_gradients_true_is_not_deepspeeds_default(here, tmp_path, model_dir):
    """`"prescale_gradients": true` was reported as DeepSpeed's default (True == 1)."""
    result, _ = import_to(tmp_path, model_dir, "ds_z2_same_update.json")
    line = next(x for x in result.lines if " prescale_gradients:" in x)
    assert "DeepSpeed's default" not in line and "not carried" in line, line
    line = next(x for x in result.lines if " gradient_predivide_factor:" in x)
    assert "not carried" in line, line


def test_keys_import_reports_as_same_update_are_not_differences_in_check(here, tmp_path, model_dir):
    """Every key the import lists as "not carried" is a note in check --against, not a difference, so an imported
    recipe passes check against its own source."""
    from ftkit.imports.mapping import NO_EFFECT

    result, out = import_to(tmp_path, model_dir, "ds_z2_same_update.json")
    not_carried = {c.key for c in result.report.claims if c.status == NO_EFFECT}
    assert {"prescale_gradients", "gradient_predivide_factor", "zero_optimization.reduce_scatter",
            "zero_optimization.offload_optimizer.ratio"} <= not_carried  # fmt: skip
    r = cli("check", str(out), "--against", "ds_z2_same_update.json")
    assert r.exit_code == 0, r.output
    for key in ("prescale_gradients", "zero_optimization.reduce_scatter", "zero_optimization.offload_optimizer.ratio"):
        assert any(f" {key}:" in x and "not compared" in x for x in r.output.splitlines()), (key, r.output)
