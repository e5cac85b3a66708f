"""Rank files written by hand, as the ranks write them: for tests of what the supervisor and ``ftkit status`` read."""

from __future__ import annotations

import json
import time

from ftkit.rundir.layout import RunDir, atomic_write


def write_rank(rd: RunDir, rank: int, host: str, compute_s: float | None, n: int, attempt: int = 0, pid: bool = True):
    """One rank's heartbeat and pid record, in the fields and places ftkit.hf writes them."""
    beat = {
        "rank": rank,
        "attempt": attempt,
        "phase": "train",
        "step": n,
        "loss": 1.0,
        "time": time.time(),
        "pid": 1000 + rank,
        "host": "same-hostname",  # network namespaces share one hostname: the hostfile name tells hosts apart
        "node": host,
        "compute_ewma_s": compute_s,
        "compute_n": n,
    }
    atomic_write(rd.heartbeat(rank), json.dumps(beat), fsync=False)
    if pid:
        rec = {"rank": rank, "host": host, "hostname": "same-hostname", "pid": 1000 + rank, "attempt": attempt}
        atomic_write(rd.pid_file(attempt, rank), json.dumps(rec), fsync=False)
