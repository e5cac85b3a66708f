"""What a rank's exit costs once its work is done: a process that imported what a rank imports (torch, transformers'
Trainer, DeepSpeed) ends, with and without :func:`ftkit.launch.rank.skip_final_collection` (``gc.freeze()`` as the
last exit handler, which every ftkit rank registers at start-up).

    python benchmarks/rank_exit.py [--repeat 3]

Prints, for each variant, the median time from the last line of the program to the end of the process (the
interpreter's shutdown: exit handlers, module teardown, the final garbage collections). A rank pays it at every
exit, a restart's teardown included; the supervisor waits for it before the next attempt starts.
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
import deepspeed
from transformers import Trainer
import torch.distributed
if sys.argv[1] == "ftkit":
    import atexit
    from ftkit.launch.rank import skip_final_collection
    atexit.register(skip_final_collection)
open(sys.argv[2], "w").write(repr(time.time()))
"""


def exit_seconds(variant: str) -> float:
    with tempfile.TemporaryDirectory() as d:
        mark = os.path.join(d, "t")
        env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
        subprocess.run([sys.executable, "-c", PROGRAM, variant, mark], check=True, env=env, capture_output=True)
        ended = time.time()
        with open(mark) as fh:
            return ended - float(fh.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for variant in ("plain", "ftkit"):
        times = [exit_seconds(variant) for _ in range(args.repeat)]
        label = "python's own shutdown" if variant == "plain" else "with skip_final_collection"
        print(f"{label:30s} median {statistics.median(times):.2f} s  ({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
