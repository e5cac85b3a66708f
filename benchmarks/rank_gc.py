"""What Python's garbage collector costs a rank when it starts and when it ends, with and without what every ftkit
rank does (:mod:`ftkit.launch.rank`): full collections deferred while the libraries load
(:func:`defer_full_collections`), and ``gc.freeze()`` as the last exit handler (:func:`skip_final_collection`).

    python benchmarks/rank_gc.py [--repeat 5]

A process imports what a rank imports (torch, DeepSpeed, transformers' Trainer and model classes, accelerate,
peft), then ends. Prints, per variant, the median import time and the median time from the program's last line to
the end of the process (exit handlers, module teardown, the final collections). Every attempt of a run pays both:
a restart waits for the old ranks to end and the new ones to start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROGRAM = """
import sys, time
t0 = time.time()
if sys.argv[1] == "ftkit":
    import atexit
    from ftkit.launch.rank import defer_full_collections, skip_final_collection
    atexit.register(skip_final_collection)
    defer_full_collections()
import deepspeed
from transformers import AutoModelForCausalLM, Trainer
import accelerate, peft, torch.distributed
if sys.argv[1] == "ftkit":
    from ftkit.launch.rank import resume_full_collections
    resume_full_collections()
t1 = time.time()
open(sys.argv[2], "w").write(f"{t1 - t0} {time.time()}")
"""


def one(variant: str) -> tuple[float, float]:
    """(import seconds, exit seconds) of one process."""
    with tempfile.TemporaryDirectory() as d:
        mark = os.path.join(d, "t")
        env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
        subprocess.run([sys.executable, "-c", PROGRAM, variant, mark], check=True, env=env, capture_output=True)
        ended = time.time()
        with open(mark) as fh:
            imported, last = (float(x) for x in fh.read().split())
        return imported, ended - last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "ftkit": []}
    for _ in range(args.repeat):  # interleaved: a busy moment of the machine hits both variants alike
        for variant in runs:
            runs[variant].append(one(variant))
    for variant, rows in runs.items():
        label = "python's defaults" if variant == "plain" else "an ftkit rank's"
        imports = statistics.median(r[0] for r in rows)
        exits = statistics.median(r[1] for r in rows)
        print(f"{label:18s} import {imports:.2f} s   exit {exits:.2f} s   (median of {len(rows)})")


if __name__ == "__main__":
    main()
