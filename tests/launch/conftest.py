"""Fixtures of the rank-side tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftkit.plan.plan import build_plan
from ftkit.recipe.load import load_recipe
from ftkit.run.make_spec import build_spec
from ftkit.rundir.layout import RunDir


@pytest.fixture
def spec_run_dir(tmp_path: Path, write_recipe, model_dir: Path) -> Path:  # noqa: ARG001 (model_dir: the recipe's)
    """A run directory with the spec.json ``ftkit launch`` would write for the default test recipe (a one-line
    data file beside it), for a process that calls ``ftkit.hf.start`` on it."""
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    plan = build_plan(load_recipe(write_recipe(), []), with_memory=False)
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    rd.spec.write_text(build_spec(plan, rd.path, rd.meta / "ds_config.json", fingerprint={}).to_json())
    return rd.path
