"""A rank's exit: every later exit handler runs on a live heap, then the final garbage collections are skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ftkit.plan.plan import build_plan
from ftkit.recipe.load import load_recipe
from ftkit.run.spec import build_spec
from ftkit.rundir.layout import RunDir
from tests.helpers.paths import REPO

RECIPE = """\
model:
  path: ./model
data:
  train: ./data.jsonl
train:
  output_dir: ./run
cluster:
  gpus_per_node: 2
  accelerator: cpu
"""

PROGRAM = """
import atexit, gc, sys
atexit.register(lambda: print("last:", gc.get_freeze_count() > 0, flush=True))  # registered first: runs last
import ftkit.hf
ftkit.hf.start(sys.argv[1], 0, log_to_console=True)
atexit.register(lambda: print("tracker:", gc.get_freeze_count() > 0, flush=True))  # as wandb's or mlflow's would
"""


def test_the_rank_freezes_the_heap_after_the_exit_handlers_registered_after_its_start(
    tmp_path: Path, write_recipe, model_dir: Path
) -> None:
    """ftkit.hf.start registers skip_final_collection before anything else of the rank, so a tracker's exit handler
    (registered when the tracker starts) still runs on a live heap, and the heap is frozen before the interpreter's
    last collections (benchmarks/rank_exit.py: ~1.7 s of every rank's exit)."""
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    plan = build_plan(load_recipe(write_recipe(RECIPE), []), with_memory=False)
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    rd.spec.write_text(build_spec(plan, rd.path, rd.meta / "ds_config.json", fingerprint={}).to_json())
    r = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(rd.path)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith(("tracker:", "last:"))]
    assert lines == ["tracker: False", "last: True"], r.stdout[-2000:] + r.stderr[-2000:]
