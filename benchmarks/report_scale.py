"""What does ``ftkit report`` cost for a very long run?

Why: a run with a local checkpoint tier saving every step writes two metrics records per step (the step's loss and
its local commit). A million-step run's report took 53 s and 1.8 GB of memory and made a 43 MB page (issue 36):
every commit was a row of the checkpoint table, and every record was held as a dict.

It writes the records of such a run by hand (the same fields ranks and agents write): one launch, ``--steps``
logged steps, a local commit per step (rotating the step before last), a durable copy every ``--save-steps``
(each agent's ``durable`` record), a diverged loss spike at one step, and a few committed checkpoints on disk;
then runs ``ftkit report`` on it in a child process and prints its wall time, peak resident memory and page size.

Usage: ``python benchmarks/report_scale.py [--steps 1000000] [--save-steps 1000] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers.ckpt import commit, make_ckpt  # noqa: E402


def write_run(run: Path, steps: int, save_steps: int) -> None:
    (run / "ftkit").mkdir(parents=True)
    (run / "ftkit" / "spec.json").write_text(json.dumps({"name": "long"}))
    t0 = 1.7e9
    step_s = 0.05
    events = [
        {"time": t0, "event": "preflight", "attempt": 0, "message": "preflight passed"},
        {"time": t0, "event": "plan", "attempt": 0, "hosts": [["node0", 8], ["node1", 8]], "world_size": 16},
        {"time": t0, "event": "fresh_start", "attempt": 0},
        {"time": t0 + 1, "event": "launch", "attempt": 0, "message": "attempt 0: starting deepspeed"},
    ]
    end = t0 + 10 + steps * step_s
    events += [
        {"time": end + 1, "event": "teardown", "attempt": 0},
        {"time": end + 2, "event": "finished", "attempt": 0, "message": "finished", "step": steps},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    with open(run / "metrics.jsonl", "w") as fh:
        for s in range(1, steps + 1):
            t = t0 + 10 + s * step_s
            loss = 1e6 if s == steps // 3 else 4.0 * math.exp(-s / steps) + 0.01 * math.sin(s)  # one diverged step
            rec = {"step": s, "loss": loss, "lr": 1e-4, "grad_norm": 1.0, "tokens_seen": 4096 * s}
            fh.write(json.dumps({**rec, "attempt": 0, "time": t}) + "\n")
            rec2 = {"event": "commit", "step": s, "attempt": 0, "tier": "local", "commit_s": 0.002}
            rec2.update(rotated=[f"checkpoint-{s - 2}"] if s > 2 else [], save_s=0.01, stop=None, time=t + 0.01)
            fh.write(json.dumps(rec2) + "\n")
            if s % save_steps == 0:
                for host in ("node0", "node1"):
                    copy = {"event": "durable", "host": host, "attempt": 0, "step": s, "bytes": 1 << 20}
                    fh.write(json.dumps({**copy, "copy_s": 0.5, "published": host == "node1", "time": t + 0.5}) + "\n")
    for s in sorted({(steps // save_steps) * save_steps - k * save_steps for k in range(2)} - {0}):
        commit(make_ckpt(run, s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--save-steps", type=int, default=1000)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftkit-report-", dir=args.dir) as tmp:
        run = Path(tmp) / "run"
        t0 = time.perf_counter()
        write_run(run, args.steps, args.save_steps)
        size = (run / "metrics.jsonl").stat().st_size
        print(f"wrote {args.steps:,} steps: metrics.jsonl {size / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s")
        out = run / "report.html"
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "ftkit", "report", str(run)],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(f"ftkit report failed ({r.returncode}): {r.stderr[-2000:]}")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        page = out.read_text()
        rows = page.count("<tr>", page.index('<section id="checkpoints">'))
        print(
            f"ftkit report: {wall:.1f} s wall, peak RSS {peak / 2**20:.0f} MiB, page {len(page) / 1e6:.2f} MB "
            f"({rows} checkpoint table rows)"
        )


if __name__ == "__main__":
    main()
