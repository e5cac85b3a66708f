"""What the optional libraries cost every process of an attempt: CPU-seconds of importing a rank's stack (torch,
transformers' Trainer, DeepSpeed, PEFT, Accelerate) and an engine's (DeepSpeed, as its runner and per-node launcher
import it), each with everything installed imported as the libraries choose, and with
:data:`ftkit.launch.rank.OPTIONAL_IMPORTS` left out (:func:`ftkit.launch.rank.leave_out`, what the built-in entry's
ranks and every engine process do).

    python benchmarks/rank_imports.py [--repeat 3]

CPU time (user + system of the child) rather than wall time, so a busy machine changes the numbers little.
Prints each variant's runs and median, interleaved.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

STACKS = {
    "rank": "import torch, transformers; from transformers import Trainer, TrainingArguments, AutoModelForCausalLM; "
    "import deepspeed, peft, accelerate",
    "engine": "import deepspeed.launcher.launch",
}
LEAVE_OUT = "from ftkit.launch.rank import OPTIONAL_IMPORTS, leave_out; leave_out(OPTIONAL_IMPORTS)\n"


def cpu_seconds(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {"DS_ACCELERATOR": "cpu", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        for stack, code in STACKS.items():
            for variant, prefix in (("everything", ""), ("left out", LEAVE_OUT)):
                runs.setdefault(f"{stack}, {variant}", []).append(cpu_seconds(prefix + code))
    for name, values in runs.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:<22} median {statistics.median(values):6.2f} CPU-s   ({shown})")


if __name__ == "__main__":
    main()
