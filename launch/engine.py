"""``python -m ftkit.launch.engine MODULE ARGS...``: an engine's launcher process, exactly as ``python -m MODULE
ARGS...`` would run it, with a lighter garbage collector.

ftkit starts every engine process it spawns this way (``ftkit launch --dry-run`` shows it): DeepSpeed's runner and
per-node launcher, ``accelerate launch``, torchrun's agent. Each imports torch (and DeepSpeed, Accelerate) only to
start its ranks, then watches them. What ftkit changes is what every rank gets too (:mod:`ftkit.launch.rank`): full
collections deferred while those libraries load, and ``gc.freeze()`` as the last exit handler, so the process does
not walk its millions of long-lived objects once more as it ends. Each attempt starts and ends these processes on
the way to its first step and on the way to the next attempt: ~1.2 s less per attempt (``benchmarks/engine_start.py``).

Nothing else differs: ``sys.argv``, ``__main__``, the exit code and the signal handlers are the module's own.
"""

from __future__ import annotations

import atexit
import runpy
import sys

from ftkit.launch.rank import defer_full_collections, skip_final_collection


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print("usage: python -m ftkit.launch.engine MODULE [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]  # run_module sets argv[0] to the module's file, as ``python -m`` does
    atexit.register(skip_final_collection)  # registered first, so it runs after the module's own exit handlers
    defer_full_collections()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
