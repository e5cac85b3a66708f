"""How long does ftkit take to notice a dead rank, and to get training going again?

Why: a restart costs (a) the time until the supervisor notices the failure, (b) the time until the new attempt
trains again (teardown, backoff, checkpoint selection, process start, model and optimizer load, resume), and
(c) the steps trained since the newest committed checkpoint, which are done again. This script measures all
three on a real 2-process CPU run of the tiny model, with a real SIGKILL sent from outside, by the pid the rank
recorded (checked against its start time), exactly as an OOM killer or a lost host would.

For each repeat it starts ``ftkit launch`` in the background, waits until rank 1 reports ``--kill-step``, kills
it, waits for the run to finish (exit 0 expected), and reads the times from ``events.jsonl`` (the supervisor's
``failure`` event) and ``metrics.jsonl`` (the first logged step of the new attempt).

Usage: ``python benchmarks/recovery.py [--engine deepspeed|accelerate|torchrun] [--steps 16] [--save-steps 4]
[--kill-step 7] [--repeats 1] [--dir DIR]``. Takes ``/tmp/ftkit-mp.lock`` so it never shares the cores with a
multi-process test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftkit.cluster.procs import is_alive  # noqa: E402
from ftkit.rundir.layout import RunDir  # noqa: E402
from tests.helpers.runs import (  # noqa: E402
    assert_no_process_left,
    events,
    heartbeat_step,
    make_fixtures,
    mp_lock,
    start_ftkit,
    wait_for,
    write_recipe,
)


def _max_step(run: Path, attempt: int) -> int:
    steps = [hb.get("step") for hb in RunDir(run).heartbeats() if hb.get("attempt") == attempt]
    return max((s for s in steps if s is not None), default=-1)


def _first_metric(run: Path, attempt: int) -> dict | None:
    for line in RunDir(run).metrics.read_text().splitlines():
        m = json.loads(line)
        if "loss" in m and m.get("attempt") == attempt:
            return m
    return None


def one(root: Path, fx: dict[str, Path], args: argparse.Namespace, i: int) -> dict[str, float]:
    d = root / f"{args.engine}-{i}"
    d.mkdir(parents=True)
    recipe = write_recipe(
        d,
        fx,
        cluster__engine=args.engine,
        train__max_steps=args.steps,
        train__save_steps=args.save_steps,
        resilience__backoff_s=args.backoff_s,
        resilience__backoff_max_s=args.backoff_s,
    )
    run = d / "run"
    proc = start_ftkit("launch", str(recipe), env={"DS_ACCELERATOR": "cpu"}, log=d / "ftkit.log")
    try:
        wait_for(lambda: heartbeat_step(run, 1) >= args.kill_step, 300, f"rank 1 at step {args.kill_step}", poll=0.02)
        rec = next(r for r in RunDir(run).records("pids", 0) if r["rank"] == 1)
        if not is_alive(int(rec["pid"]), rec.get("start_time")):
            raise SystemExit(f"rank 1 pid {rec['pid']} is not running")
        t_kill = time.time()
        os.kill(int(rec["pid"]), signal.SIGKILL)
        kill_step = _max_step(run, 0)  # the last step any rank finished: what was lost since the checkpoint
        code = proc.wait(600)
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        raise
    if code != 0:
        raise SystemExit(f"ftkit launch exited {code}; see {d / 'ftkit.log'}")
    assert_no_process_left(run)
    ev = events(run)
    failure = next(e for e in ev if e["event"] == "failure")
    chosen = next(e for e in ev if e["event"] == "checkpoint_chosen" and e["attempt"] == 1)
    spawn = next(e for e in ev if e["event"] == "spawn" and e["attempt"] == 1)
    first = _first_metric(run, 1)
    assert first is not None, "the new attempt logged no step"
    return {
        "detect_s": failure["time"] - t_kill,
        "respawn_s": spawn["time"] - t_kill,
        "progress_s": first["time"] - t_kill,
        "kill_step": kill_step,
        "resumed_step": chosen["step"],
        "recomputed": kill_step - chosen["step"],
        "restarts": sum(e["event"] == "restart" for e in ev),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["deepspeed", "accelerate", "torchrun"], default="deepspeed")
    ap.add_argument("--steps", type=int, default=16, help="train.max_steps (default 16)")
    ap.add_argument("--save-steps", type=int, default=4, help="train.save_steps (default 4)")
    ap.add_argument(
        "--kill-step",
        type=int,
        default=None,
        help="kill rank 1 once it reports this step "
        "(default: one step before the second checkpoint, the worst case for recomputation)",
    )
    ap.add_argument("--backoff-s", type=float, default=0.5, help="resilience.backoff_s (default 0.5)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dir", default=None, help="work directory (default: a new temporary one)")
    args = ap.parse_args()
    if args.kill_step is None:
        args.kill_step = 2 * args.save_steps - 1
    if not 0 < args.kill_step < args.steps:
        ap.error("--kill-step must be inside the run")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    root = Path(args.dir or tempfile.mkdtemp(prefix="ftkit-bench-recovery-"))
    fx = make_fixtures(root / "fixtures")
    rows = []
    with mp_lock():
        for i in range(args.repeats):
            rows.append(one(root, fx, args, i))
    print(
        f"engine {args.engine}, 2 CPU ranks, {args.steps} steps, save every {args.save_steps}, "
        f"kill rank 1 (SIGKILL by pid) at step >= {args.kill_step}, backoff {args.backoff_s}s; work dir {root}"
    )
    head = ("run", "kill->detected s", "kill->respawn s", "kill->training s", "kill step", "resumed", "recomputed")
    print("  ".join(f"{h:>16}" for h in head))
    for i, r in enumerate(rows):
        vals = (
            i,
            f"{r['detect_s']:.2f}",
            f"{r['respawn_s']:.2f}",
            f"{r['progress_s']:.2f}",
            r["kill_step"],
            r["resumed_step"],
            r["recomputed"],
        )
        print("  ".join(f"{v!s:>16}" for v in vals))
    if len(rows) > 1:
        med = [statistics.median(r[k] for r in rows) for k in ("detect_s", "respawn_s", "progress_s", "recomputed")]
        print(
            "  ".join(
                f"{v!s:>16}"
                for v in ("median", f"{med[0]:.2f}", f"{med[1]:.2f}", f"{med[2]:.2f}", "", "", f"{med[3]:g}")
            )
        )
    bad = [r for r in rows if r["restarts"] != 1]
    if bad:
        print(f"warning: {len(bad)} run(s) restarted more than once")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        print(e.stderr, file=sys.stderr)
        raise
