"""Build DeepSpeed's just-in-time ops once per host, before any rank: ``python -m ftkit.launch.warmup [--ops ...]``.

An op that is not prebuilt is compiled the first time a rank uses it (CPU Adam for optimizer offload, async I/O for
NVMe offload; on the cpu accelerator also the shared-memory collectives). Done inside a supervised run, N ranks
queue behind one build lock, the time counts against ``resilience.startup_timeout_s``, and a build error is N
tracebacks and a restart. ``ftkit launch`` runs this module once on every host that needs a build (its preflight
found the op neither prebuilt nor built there, :mod:`ftkit.run.ops`): a failure is one line per host before any
rank starts. ``make install`` runs it with no arguments: CPU Adam and the shared-memory collectives of the cpu
accelerator, so later test runs find them in ``~/.cache/torch_extensions``.

The builds run with the ``PATH`` every rank gets (:func:`ftkit.rundir.env.path_with_python_first`), so the ninja
the ranks run finds them current. One op after another: ninja already compiles an op's sources in parallel (two
at once took 95 s on 2 cores, one after the other 67 s).

A build lock no process on the host holds (a killed build left it, :mod:`ftkit.cluster.buildlocks`) is removed
first, with one line: torch would wait on it forever.

With ``--json`` the last line is ``FTKIT_WARMUP {"op": {"ok": bool, "seconds": s, "error": "last line"}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from ftkit.cluster.buildlocks import clear_stale_locks
from ftkit.rundir.env import path_with_python_first

MARK = "FTKIT_WARMUP "
# DeepSpeed's builder name -> its OpBuilder class name (deepspeed.ops.op_builder)
BUILDERS = {
    "cpu_adam": "CPUAdamBuilder",
    "fused_adam": "FusedAdamBuilder",
    "async_io": "AsyncIOBuilder",
    "deepspeed_shm_comm": "ShareMemCommBuilder",
}
DEFAULT_OPS = ("cpu_adam", "deepspeed_shm_comm")


def _last_line(e: BaseException) -> str:
    """The error's own last meaningful line (a build error's compiler message is in the exception's text)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]


def build(ops: list[str]) -> dict[str, dict[str, object]]:
    os.environ["PATH"] = path_with_python_first(sys.executable, os.environ.get("PATH"))
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    out: dict[str, dict[str, object]] = {}
    # a build killed while it held torch's baton left its lock: torch would wait on it forever (make install hung
    # until CI's time ran out); a lock no process holds is removed, one line each
    for lock in clear_stale_locks(ops):
        print(f"removed a stale build lock: {lock} (a killed build left it; nothing on this host held it)", flush=True)
    for op in ops:
        t0 = time.monotonic()
        name = BUILDERS.get(op, op)
        try:
            builder = acc.create_op_builder(name)
            if builder is None or not builder.is_compatible():
                out[op] = {"ok": None, "error": f"{name} is not available on the {acc.device_name()} accelerator"}
                print(f"{name}: not available on the {acc.device_name()} accelerator, skipped", flush=True)
                continue
            builder.load(verbose=False)
        except Exception as e:  # noqa: BLE001 - every build error becomes one line for the launch
            traceback.print_exc()
            out[op] = {"ok": False, "seconds": round(time.monotonic() - t0, 1), "error": _last_line(e)}
            continue
        out[op] = {"ok": True, "seconds": round(time.monotonic() - t0, 1)}
        print(f"{name}: ready ({time.monotonic() - t0:.0f}s)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftkit.launch.warmup")
    ap.add_argument("--ops", default=",".join(DEFAULT_OPS), help="comma-separated DeepSpeed op names")
    ap.add_argument("--json", action="store_true", help="end with one FTKIT_WARMUP {json} line")
    args = ap.parse_args(argv)
    result = build([op for op in args.ops.split(",") if op])
    if args.json:
        sys.stdout.write(MARK + json.dumps(result) + "\n")
        sys.stdout.flush()
    return 1 if any(r.get("ok") is False for r in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
