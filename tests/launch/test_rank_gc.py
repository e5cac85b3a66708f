"""The garbage collector in a rank: full collections deferred while the libraries load, until training begins; at
exit, every later exit handler runs on a live heap, then the final collections are skipped."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import REPO

PROGRAM = """
import atexit, gc, sys
atexit.register(lambda: print("last:", gc.get_freeze_count() > 0, flush=True))  # registered first: runs last
import ftkit.hf
print("before:", gc.get_threshold(), flush=True)
ctx = ftkit.hf.start(sys.argv[1], 0, log_to_console=True)
print("loading:", gc.get_threshold(), flush=True)
ctx.heartbeat("loading")
print("still loading:", gc.get_threshold(), flush=True)
ctx.heartbeat("train", 1)
print("training:", gc.get_threshold(), flush=True)
atexit.register(lambda: print("tracker:", gc.get_freeze_count() > 0, flush=True))  # as wandb's or mlflow's would
"""


def test_full_collections_wait_for_training_and_the_heap_is_frozen_after_the_later_exit_handlers(
    spec_run_dir: Path,
) -> None:
    """From ftkit.hf.start to the first training heartbeat the oldest generation's threshold is 1000x Python's
    (benchmarks/rank_gc.py: ~0.9 s of every rank's start), then Python's own again. skip_final_collection is
    registered before anything else of the rank, so a tracker's exit handler (registered when the tracker starts)
    still runs on a live heap, and the heap is frozen before the interpreter's last collections (~1.4 s of every
    rank's exit)."""
    r = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(spec_run_dir)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    out = r.stdout[-2000:] + r.stderr[-2000:]
    said = dict(x.split(": ", 1) for x in r.stdout.splitlines() if ": " in x)
    first, second, third = ast.literal_eval(said["before"])
    assert said["loading"] == said["still loading"] == str((first, second, third * 1000)), out
    assert said["training"] == said["before"], out
    lines = [x for x in r.stdout.splitlines() if x.startswith(("tracker:", "last:"))]
    assert lines == ["tracker: False", "last: True"], out
