"""``python -m ftkit.launch.engine MODULE ARGS...``: an engine's launcher process, exactly as ``python -m MODULE
ARGS...`` would run it, with a lighter garbage collector.

ftkit starts every engine process it spawns this way (``ftkit launch --dry-run`` shows it): DeepSpeed's runner and
per-node launcher, ``accelerate launch``, torchrun's agent. Each imports torch (and DeepSpeed, Accelerate) only to
start its ranks, then watches them. What ftkit changes is what every rank gets too (:mod:`ftkit.launch.rank`): full
collections deferred while those libraries load, and ``gc.freeze()`` as the last exit handler, so the process does
not walk its millions of long-lived objects once more as it ends. Each attempt starts and ends these processes on
the way to its first step and on the way to the next attempt: ~1.2 s less per attempt (``benchmarks/engine_start.py``).

Nothing else differs: ``sys.argv``, ``__main__``, the exit code and the signal handlers are the module's own, but
what the engine itself prints passes through :class:`ftkit.rundir.env.Redactor`: DeepSpeed's runner logs the whole
pdsh line, ``export HF_TOKEN=...`` included, and that log is ``logs/attempt-N/launcher-node0.log`` in the run
directory. (The ranks write to the same file descriptors directly: their output is untouched.)
"""

from __future__ import annotations

import atexit
import io
import os
import runpy
import sys
from typing import TextIO

from ftkit.launch.rank import OPTIONAL_IMPORTS, defer_full_collections, leave_out, skip_final_collection
from ftkit.rundir.env import Redactor


class MaskedStream(io.TextIOBase):
    """A text stream that writes through ``stream`` with every secret masked (one ``write`` at a time: a logging
    record is one write)."""

    def __init__(self, stream: TextIO, redactor: Redactor):
        self._stream = stream
        self._redactor = redactor

    def write(self, s: str) -> int:
        self._stream.write(self._redactor.text(s))
        return len(s)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # TextIOBase declares it read-only
        return self._stream.encoding


def engine_redactor(environ: dict[str, str] | os._Environ[str]) -> Redactor:
    """Masks this process's secrets and those of DeepSpeed's env file (``DS_ENV_FILE``), which its runner exports
    on the pdsh line it logs."""
    lines: list[str] = []
    path = environ.get("DS_ENV_FILE")
    if path:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            pass
    return Redactor(environ, extra=lines)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print("usage: python -m ftkit.launch.engine MODULE [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]  # run_module sets argv[0] to the module's file, as ``python -m`` does
    atexit.register(skip_final_collection)  # registered first, so it runs after the module's own exit handlers
    redactor = engine_redactor(os.environ)
    sys.stdout = MaskedStream(sys.stdout, redactor)  # before the engine imports its logging: its handlers keep it
    sys.stderr = MaskedStream(sys.stderr, redactor)
    defer_full_collections()
    leave_out(OPTIONAL_IMPORTS)  # an engine only starts and watches ranks: it logs to no tracker, reads no dataset
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
