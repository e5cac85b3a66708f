"""`make demo`: the main job end to end on a built-in tiny default, with a failure on purpose.

1. makes a tiny llama-style model, tokenizer and learnable dataset (nothing downloaded);
2. scaffolds a recipe with ``ftkit init --template cpu-demo`` and shows ``ftkit plan`` and the rendered configs;
3. ``ftkit launch``es a 2-process CPU run with ZeRO-2, kills one rank (SIGKILL, by pid, from outside) part-way,
   and lets ftkit recover from the newest committed checkpoint;
4. prints a summary (steps, restarts, loss at start and end, where everything is) and draws the loss curve.

Every step is a real ``ftkit`` command, run the way a user would type it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from ftkit.run.status import SummaryDict

KILL_AT_STEP = 14


def say(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def run(argv: list[str], *, show: bool = True) -> subprocess.CompletedProcess[str]:
    print(
        "$ "
        + " ".join(argv[2:] if argv[:3] == [sys.executable, "-m", "ftkit"] else argv).replace(sys.executable, "python"),
        flush=True,
    )
    out = subprocess.run(argv, text=True, capture_output=not show)
    if out.returncode != 0:
        if not show:
            print(out.stdout + out.stderr)
        raise SystemExit(f"demo: command failed with exit {out.returncode}")
    return out


def ftkit(*args: str) -> list[str]:
    return [sys.executable, "-m", "ftkit", *args]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="demo-run", help="Workspace (deleted and recreated). Default: ./demo-run")
    ap.add_argument("--no-kill", action="store_true", help="Do not kill a rank.")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    work = Path(args.dir).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)

    say(f"1/5 making a tiny model, tokenizer and dataset in {work} (built from a config, nothing downloaded)")
    run([sys.executable, "-m", "ftkit.launch.fixtures", str(work)])

    say("2/5 scaffolding a recipe with ftkit init (every key documented above it)")
    run(ftkit("init", str(work), "--template", "cpu-demo", "--force"))
    recipe = str(work / "recipe.yaml")

    say("3/5 planning memory and rendering the configs")
    run(ftkit("plan", recipe))
    run(ftkit("render", recipe))
    for name in ("ds_config.json", "accelerate.yaml"):
        print(f"--- {work / 'configs' / name}")
        print((work / "configs" / name).read_text())

    run_dir = work / "runs" / "cpu-demo"
    kill_note = "" if args.no_kill else f" (rank 1 will be killed at step {KILL_AT_STEP} on purpose)"
    say(f"4/5 launching a 2-process CPU run with ZeRO-2{kill_note}")
    print(f"$ ftkit launch {recipe}", flush=True)
    proc = subprocess.Popen(ftkit("launch", recipe), start_new_session=True)
    killed = None
    try:
        if not args.no_kill:
            killed = _kill_rank_when(run_dir, rank=1, step=KILL_AT_STEP, proc=proc)
        code = proc.wait(timeout=900)
    except BaseException:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        raise
    if code != 0:
        raise SystemExit(f"demo: ftkit launch exited {code}")

    say("5/5 summary")
    plot = work / "loss.png"
    out = run(ftkit("status", str(run_dir), "--plot", str(plot), "--json"), show=False)
    s = cast("SummaryDict", json.loads(out.stdout.split("\nwrote ")[0]))  # ftkit status --json
    print(f"steps:        {s['step']}/{s['max_steps']}")
    print(
        f"restarts:     {s['restarts']}"
        + (
            f" (rank 1, pid {killed}, SIGKILLed after step {KILL_AT_STEP}; {_resumed_words(s)})"
            if killed and s["resumes"]
            else ""
        )
    )
    print(f"loss:         {s['first_loss']:.4f} at step 1 -> {s['last_loss']:.4f} at step {s['step']}")
    committed = [Path(c["path"]).name for c in s["checkpoints"] if c["committed"]]
    print(f"checkpoints:  {', '.join(committed)} in {run_dir} (each with ftkit_commit.json)")
    print(f"final model:  {s['final']}  (loads with AutoModelForCausalLM.from_pretrained)")
    print(f"logs:         {run_dir / 'logs'} (one file per rank per attempt)")
    print(f"events:       {run_dir / 'events.jsonl'}   (every decision ftkit made)")
    print(f"loss curve:   {plot}")
    print(f"took {time.monotonic() - t0:.0f}s.  Next: `ftkit status {run_dir}`, or read README.md.")
    return 0


def _resumed_words(s: SummaryDict) -> str:
    """How the restart resumed: from which step and tier, and whether that was the last step the killed attempt
    completed (the local tier's promise: a crash costs at most the step in flight)."""
    _, step, tier = s["resumes"][-1]
    done = max((st for st, _, attempt in s["all_losses"] if attempt == 0), default=None)
    where = {"local": "from the local checkpoint tier in /dev/shm", "peer": "from a peer's copy"}.get(
        tier, "from the run directory"
    )
    if done is not None and step >= done:
        return f"resumed from step {step}, the last step completed before the kill, {where}"
    return f"resumed from step {step} {where}; steps {step + 1}-{done} were recomputed"


def _kill_rank_when(run_dir: Path, *, rank: int, step: int, proc: subprocess.Popen[bytes]) -> int | None:
    """Wait until ``rank`` reports ``step`` in its heartbeat, then SIGKILL it by the pid it recorded."""
    hb = run_dir / "ftkit" / "heartbeat" / f"rank-{rank}.json"
    while proc.poll() is None:
        try:
            rec = json.loads(hb.read_text())
        except (OSError, ValueError):
            rec = {}
        if rec.get("attempt") == 0 and (rec.get("committed") or 0) >= step:  # the step and its (local) save done
            pid = int(rec["pid"])
            print(f"demo: killing rank {rank} (pid {pid}) with SIGKILL at step {rec['step']}", flush=True)
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.05)
    return None


if __name__ == "__main__":
    sys.exit(main())
