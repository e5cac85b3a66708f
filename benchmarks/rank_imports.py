"""What the optional libraries cost every process of an attempt: CPU-seconds of importing a rank's stack (torch,
transformers' Trainer, DeepSpeed, Accelerate; PEFT as the Trainer imports it) and an engine's (DeepSpeed, as its
runner and per-node launcher import it), each with everything installed imported as the libraries choose, and with
:data:`ftkit.launch.rank.OPTIONAL_IMPORTS` left out (:func:`ftkit.launch.rank.leave_out`, what the built-in entry's
ranks and every engine process do), and with only DeepSpeed's autotuner kept from importing mlflow
(:data:`ftkit.launch.rank.AUTOTUNER_WITHOUT_MLFLOW`, what every rank does, a user's script's too).

A third stack is a rank as far as ``deepspeed.initialize``'s optimizer check: it imports DeepSpeed's Muon optimizer,
whose three kernels are decorated with ``torch.compile`` at import time, loading TorchInductor; measured as DeepSpeed
does it and with the decorator applied at each kernel's first call instead (what every ftkit rank does,
``ftkit.launch.rank._compile_on_first_call``).

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
    "import deepspeed, accelerate",
    "engine": "import deepspeed.launcher.launch",
}
MUON = "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam"
LEAVE_OUT = "from ftkit.launch.rank import OPTIONAL_IMPORTS, leave_out; leave_out(OPTIONAL_IMPORTS)\n"
HIDE = (
    "from ftkit.launch.rank import AUTOTUNER_WITHOUT_MLFLOW, hide_while_importing\n"
    "hide_while_importing(*AUTOTUNER_WITHOUT_MLFLOW)\n"
)
LAZY = (
    "from ftkit.launch.rank import _compile_on_first_call, on_import\n"
    "on_import('deepspeed.runtime.compiler', _compile_on_first_call)\n"
)


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
            for variant, prefix in (("everything", ""), ("autotuner w/o mlflow", HIDE), ("left out", LEAVE_OUT)):
                runs.setdefault(f"{stack}, {variant}", []).append(cpu_seconds(prefix + code))
        rank = LEAVE_OUT + STACKS["rank"] + "\n" + MUON
        for variant, prefix in (("as DeepSpeed does", ""), ("first call", LAZY)):
            runs.setdefault(f"muon check, {variant}", []).append(cpu_seconds(prefix + rank))
    for name, values in runs.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:<31} median {statistics.median(values):6.2f} CPU-s   ({shown})")


if __name__ == "__main__":
    main()
