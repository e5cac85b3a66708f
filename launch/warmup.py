"""Compile DeepSpeed's just-in-time CPU ops once, before any timed run: ``python -m ftkit.launch.warmup``.

On the cpu accelerator DeepSpeed builds CPU Adam (optimizer offload) and its shared-memory collectives on first
use, which takes 1-2 minutes on 2 cores. Done inside a supervised run, that time counts against
``resilience.startup_timeout_s``; done here (``make install`` runs it), later runs find the build cached in
``~/.cache/torch_extensions``. On GPU machines the CUDA ops are prebuilt or built the same way on first use.

The builds run with the ``PATH`` every rank gets (:func:`ftkit.rundir.env.path_with_python_first`), so the ninja
the ranks run finds them current. One op after another: ninja already compiles an op's sources in parallel (two
at once took 95 s on 2 cores, one after the other 67 s).
"""

from __future__ import annotations

import os
import sys
import time

from ftkit.rundir.env import path_with_python_first


def main() -> int:
    os.environ["PATH"] = path_with_python_first(sys.executable, os.environ.get("PATH"))
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        t0 = time.monotonic()
        builder = acc.create_op_builder(name)
        if builder is None or not builder.is_compatible():
            print(f"{name}: not available on the {acc.device_name()} accelerator, skipped")
            continue
        builder.load(verbose=False)
        print(f"{name}: ready ({time.monotonic() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
