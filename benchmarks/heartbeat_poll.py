"""What does one supervisor poll of the heartbeats cost with 1,024 ranks?

Why: the supervisor reads every rank's heartbeat file once per poll (``RunDir.heartbeats()``, ftkit/supervise.py)
to time progress on its own clock. At 128 nodes × 8 GPUs that is 1,024 files per poll; the poll must stay well
under its interval (target: < 50 ms) or the supervisor itself becomes the bottleneck.

It writes 1,024 heartbeat files as ranks do (``atomic_write``: temp file, rename), then times polls on one
``RunDir``: the first (reads everything), steady polls with nothing changed, and polls after 1/8 of the ranks
(one 8-GPU node in 8) rewrote their heartbeat, and polls after every rank did (training steps shorter than the
supervisor's 0.5 s poll: every file is new at every poll).

Usage: ``python benchmarks/heartbeat_poll.py [--ranks 1024] [--polls 20] [--dir DIR]`` (DIR: a directory on the
file system to measure, e.g. a shared one; default a temporary directory on local disk).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftkit.rundir.layout import RunDir, atomic_write  # noqa: E402


def beat(rd: RunDir, rank: int, step: int) -> None:
    rec = {"rank": rank, "attempt": 0, "phase": "train", "step": step, "loss": 1.5, "time": time.time()}
    rec.update({"pid": 1000 + rank, "host": "h", "node": f"node{rank // 8}", "compute_ewma_s": 0.2, "compute_n": 9})
    atomic_write(rd.heartbeat(rank), json.dumps(rec), fsync=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--polls", type=int, default=20)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftkit-hb-", dir=args.dir) as tmp:
        writer = RunDir(tmp)
        for r in range(args.ranks):
            beat(writer, r, 0)
        rd = RunDir(tmp)  # the supervisor's own RunDir, as in supervise.py
        t0 = time.perf_counter()
        first = rd.heartbeats()
        first_ms = (time.perf_counter() - t0) * 1e3
        assert len(first) == args.ranks
        steady, changed, every = [], [], []
        for i in range(args.polls):
            t0 = time.perf_counter()
            hbs = rd.heartbeats()
            steady.append((time.perf_counter() - t0) * 1e3)
            assert len(hbs) == args.ranks
            for r in range(i % 8, args.ranks, 8):  # one rank in 8 beats between polls
                beat(writer, r, i + 1)
            t0 = time.perf_counter()
            hbs = rd.heartbeats()
            changed.append((time.perf_counter() - t0) * 1e3)
            seen = {h["rank"]: h["step"] for h in hbs}
            assert all(seen[r] == i + 1 for r in range(i % 8, args.ranks, 8)), "a new heartbeat was not seen"
            for r in range(args.ranks):  # every rank beats between polls (steps shorter than the poll interval)
                beat(writer, r, i + 1)
            t0 = time.perf_counter()
            hbs = rd.heartbeats()
            every.append((time.perf_counter() - t0) * 1e3)
            assert all(h["step"] == i + 1 for h in hbs)
    print(f"{args.ranks} heartbeat files, {args.polls} polls each (ms; median / max)")
    print(f"  first poll (reads all):        {first_ms:7.1f}")
    print(f"  nothing changed:               {statistics.median(steady):7.1f} / {max(steady):6.1f}")
    print(f"  1/8 of the ranks beat:         {statistics.median(changed):7.1f} / {max(changed):6.1f}")
    print(f"  every rank beat:               {statistics.median(every):7.1f} / {max(every):6.1f}")
    worst = max(max(steady), max(changed), max(every))
    print(f"  worst steady-state poll {worst:.1f} ms: {'ok' if worst < 50 else 'OVER'} the 50 ms target")


if __name__ == "__main__":
    main()
