"""One resolved, typed run record crosses to the ranks (issue 39, point 1): ``ftkit/spec.json`` of a prepared run
holds no ``auto`` and no raw recipe (the recipe stays only as provenance: its hash and the fingerprint, and the
head's own ``ftkit/recipe.json``), and it reads back as the typed :class:`RunSpec` the ranks use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftkit.errors import UserError
from ftkit.plan.load import load_and_plan
from ftkit.recipe.schema import SECTIONS
from ftkit.run.prepare import prepare_run
from ftkit.rundir.sections import ResilienceSection
from ftkit.rundir.spec import RunSpec

# Everything a planner may choose left to it: the ZeRO stage, its knobs, the local tier's place and cadence.
AUTO = """\
model:
  path: ./model
data:
  train: ./data.jsonl
train:
  output_dir: ./run
  micro_batch_size: 2
  global_batch_size: 16
zero:
  stage: auto
checkpoint:
  local_dir: auto
  local_steps: auto
cluster:
  gpus_per_node: 8
  gpu_memory_gb: 80
resilience:
  orphan_timeout_s: 45
"""


def _autos(value: object, where: str = "") -> list[str]:
    """The dotted places in ``value`` (JSON data) that hold the string ``auto``."""
    if isinstance(value, dict):
        return [w for k, v in value.items() for w in _autos(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [w for i, v in enumerate(value) for w in _autos(v, f"{where}[{i}]")]
    return [where] if value == "auto" else []


@pytest.fixture
def prepared(write_recipe) -> Path:
    recipe = write_recipe(AUTO)
    return prepare_run(load_and_plan(str(recipe), [])).path


def test_spec_json_holds_no_auto_and_no_raw_recipe(prepared: Path) -> None:
    raw = json.loads((prepared / "ftkit" / "spec.json").read_text())
    # The fingerprint is the recipe's provenance (what a resume compares, as the user wrote it): the one place the
    # recipe's own values, autos included, may appear. Everything the ranks read is resolved.
    assert _autos({k: v for k, v in raw.items() if k != "fingerprint"}) == []
    assert "recipe" not in raw
    # of the recipe's sections only the typed, resolved parts the ranks use (no model, train, zero, checkpoint, ...)
    assert set(raw) & {s.name for s in SECTIONS} == {"data", "peft", "resilience"}
    assert raw["recipe_hash"] and raw["fingerprint"]["recipe"]["zero.stage"] == "auto"
    # the autos were resolved on the head: a stage, a local tier with its cadence, the backend
    assert isinstance(raw["stage"], int) and raw["backend"] in ("deepspeed", "fsdp2")
    assert raw["local_tier"] is not None and isinstance(raw["local_tier"]["steps"], int)
    assert raw["training_args"]["save_steps"] == raw["local_tier"]["steps"]


def test_spec_reads_back_typed_with_every_default_applied(prepared: Path) -> None:
    spec = RunSpec.read(prepared / "ftkit" / "spec.json")
    assert isinstance(spec.resilience, ResilienceSection)
    assert spec.resilience.orphan_timeout_s == 45  # the recipe's value
    assert spec.resilience.stop_timeout_s == 120.0 and spec.resilience.checksum == "full"  # the schema's defaults
    assert (spec.backend, spec.precision) == ("deepspeed", "bf16")
    # the resolved recipe stays beside the spec for the commands that read the run afterwards (no rank reads it)
    recipe = json.loads((prepared / "ftkit" / "recipe.json").read_text())
    assert recipe["zero"]["stage"] == "auto" and recipe["resilience"]["orphan_timeout_s"] == 45


def test_a_spec_written_before_the_recipe_left_it_is_refused_in_one_line(prepared: Path) -> None:
    path = prepared / "ftkit" / "spec.json"
    old = json.loads(path.read_text())
    for key in ("backend", "precision", "resilience"):
        del old[key]
    path.write_text(json.dumps({**old, "recipe": {"train": {"precision": "fp32"}}}))
    with pytest.raises(UserError) as e:
        RunSpec.read(path)
    (line,) = str(e.value).splitlines()
    assert "unknown field(s) ['recipe']" in line and "relaunch with this one" in line, line
