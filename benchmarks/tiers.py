"""What does a save block the ranks for, synchronous to the run directory vs the node-local tier, and what does a
crash cost with the tier on?

Why: ftkit's promise is "no completed work lost", but a durable save blocks every rank while it writes to shared
storage, so teams save rarely and a crash loses a whole save interval. The local tier (issue 24) saves to
/dev/shm and copies to the run directory in the background. This script measures both halves of that claim.

**Part 1, blocking time per save** at 256 MiB, 1 GiB and 4 GiB checkpoints. Two rank processes each write their
half (torch.save of fp32 tensors, as DeepSpeed's shards are), then do exactly what ftkit's commit does after an HF
Trainer save (:func:`ftkit.checkpoint.commit.manifest_part`: fsync and XXH3-128 of every byte, then
:func:`write_commit` on rank 0). *Synchronous*: into ``RUN/checkpoint-N`` on a run directory slowed to stand in for
network storage: an ext4 file system on a loop device whose writes are throttled by the cgroup-v1 blkio controller
(``blkio.throttle.write_bps_device``; ``--limit-mbs``, default 240 MB/s, which measures ~200 MB/s with fsync).
*Local tier*: into ``/dev/shm``, committed per node, then the background copy to the same slowed run directory
(:func:`ftkit.checkpoint.tiers.copy_to_durable` and :func:`publish`, as the agent runs them) is timed apart: it
overlaps training. Overhead at the chosen cadence: the Young/Daly interval sqrt(2 C M) for the measured cost C and
``--mtbf-hours``, and C / interval (the share of wall time the ranks block for saves).

**Part 2, steps recomputed per crash** (``--storm N``, default 20): a real 2-rank LoRA run of the tiny model with
``checkpoint.local_steps: 1``; N SIGKILLs of a random rank at random moments (mid-step, mid-save, mid-copy), each
after 1-2 new steps; per kill, the newest step the killed attempt logged less the step the next attempt resumed
from, and the tier every resume came from (events.jsonl).

Needs root (loop device, blkio cgroup). Usage: ``python benchmarks/tiers.py [--sizes 256M,1G,4G] [--repeats 3]
[--storm 20] [--skip-storm] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftkit.checkpoint.commit import manifest_part, write_commit  # noqa: E402
from ftkit.checkpoint.tiers import NodePart, copy_to_durable, publish  # noqa: E402
from ftkit.checkpoint.verify import verify  # noqa: E402
from ftkit.rundir.layout import RunDir, read_jsonl  # noqa: E402
from tests.helpers.runs import (  # noqa: E402
    RUN_ENV,
    heartbeat_step,
    kill_tree,
    losses,
    make_fixtures,
    mp_lock,
    named,
    rank_pid,
    start_ftkit,
    wait_for,
    write_recipe,
)

SIZES = {"256M": 256 << 20, "1G": 1 << 30, "4G": 4 << 30}
RANKS = 2


# ------------------------------------------------------------------------------------------------ slowed run dir


class SlowDisk:
    """An ext4 file system on a loop device with a blkio write limit: the stand-in for network storage."""

    def __init__(self, root: Path, size_gb: int, limit_mbs: float):
        self.image, self.mount = root / "slowdisk.img", root / "slow"
        self.limit = int(limit_mbs * 1e6)
        subprocess.run(["truncate", "-s", f"{size_gb}G", str(self.image)], check=True)
        self.dev = subprocess.run(
            ["losetup", "-f", "--show", str(self.image)], check=True, capture_output=True, text=True
        ).stdout.strip()
        subprocess.run(["mkfs.ext4", "-q", self.dev], check=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", self.dev, str(self.mount)], check=True)
        st = os.stat(self.dev)
        self.majmin = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        self._throttle(self.limit)

    def _throttle(self, bps: int) -> None:
        Path("/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device").write_text(f"{self.majmin} {bps}\n")

    def measured_mbs(self) -> float:
        f = self.mount / "probe"
        t0 = time.perf_counter()
        with open(f, "wb") as fh:
            block = os.urandom(8 << 20)
            for _ in range(64):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        dt = time.perf_counter() - t0
        f.unlink()
        return 512 * 2**20 / dt / 1e6

    def close(self) -> None:
        self._throttle(0)
        subprocess.run(["umount", str(self.mount)], check=False)
        subprocess.run(["losetup", "-d", self.dev], check=False)
        self.image.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ one save


def _rank_save(rank: int, ckpt: str, nbytes: int, barrier: mp.Barrier, out: mp.Queue) -> None:
    import torch

    # the rank's half of the checkpoint, in 256 MiB tensors (a ZeRO shard file per rank, as DeepSpeed writes)
    n = nbytes // RANKS // 4
    chunks = [torch.randn(min(n - i, 64 << 20)) for i in range(0, n, 64 << 20)]
    barrier.wait()
    t0 = time.perf_counter()
    d = Path(ckpt) / "global_step1"
    d.mkdir(parents=True, exist_ok=True)
    torch.save({"optimizer_state_dict": chunks}, d / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    if rank == 0:
        torch.save({"module": {}}, d / "mp_rank_00_model_states.pt")  # DeepSpeed's module states (small here)
        (Path(ckpt) / "latest").write_text("global_step1")
        torch.save({"step": 1}, Path(ckpt) / "scheduler.pt")
        (Path(ckpt) / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    torch.save({"rng": rank}, Path(ckpt) / f"rng_state_{rank}.pth")
    written = time.perf_counter()
    barrier.wait()  # every rank wrote: the manifest (fsync + hash) of its own files
    part = manifest_part(ckpt, rank, RANKS)
    out.put((rank, part, written - t0))
    barrier.wait()
    out.put(("t", rank, time.perf_counter() - t0))


def blocking_save(ckpt: Path, nbytes: int, extra: dict) -> tuple[float, float]:
    """(seconds the ranks blocked: write + commit, seconds writing alone)."""
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(RANKS + 1), ctx.Queue()
    procs = [ctx.Process(target=_rank_save, args=(r, str(ckpt), nbytes, barrier, q)) for r in range(RANKS)]
    for p in procs:
        p.start()
    barrier.wait()  # tensors allocated: the save begins
    t0 = time.perf_counter()
    barrier.wait()
    parts = {}
    writes = []
    for _ in range(RANKS):
        rank, part, w = q.get()
        parts[rank] = part
        writes.append(w)
    write_commit(
        ckpt, [parts[r] for r in range(RANKS)], step=1, world_size=RANKS, stage=2, recipe_hash="bench", extra=extra
    )
    barrier.wait()
    blocked = time.perf_counter() - t0
    for _ in range(RANKS):
        q.get()
    for p in procs:
        p.join()
    return blocked, max(writes)


def part1(args: argparse.Namespace, root: Path) -> list[dict]:
    need_gb = max(SIZES[s] for s in args.sizes) * 2 // 2**30 + 4
    disk = SlowDisk(root, need_gb, args.limit_mbs)
    rows = []
    try:
        mbs = disk.measured_mbs()
        print(
            f"run directory: ext4 on {disk.dev}, blkio write limit {args.limit_mbs:g} MB/s, measured "
            f"{mbs:.0f} MB/s with fsync (unthrottled /dev/shm for the local tier)"
        )
        shm_root = Path(tempfile.mkdtemp(prefix="ftkit-bench-tiers-", dir="/dev/shm"))
        try:
            for label in args.sizes:
                nbytes = SIZES[label]
                sync_s, local_s, copy_s = [], [], []
                for rep in range(args.repeats):
                    run = disk.mount / f"run-{label}-{rep}"
                    run.mkdir()
                    s, _ = blocking_save(run / "checkpoint-1", nbytes, {"tier": "durable"})
                    sync_s.append(s)
                    assert verify(run / "checkpoint-1", False, require_commit=True).ok
                    shutil.rmtree(run / "checkpoint-1")
                    local = shm_root / f"{label}-{rep}" / "checkpoint-1"
                    s, _ = blocking_save(local, nbytes, {"tier": "local", "nodes": ["localhost"]})
                    local_s.append(s)
                    rec = json.loads((local / "ftkit_commit.json").read_text())
                    t0 = time.perf_counter()
                    copy_to_durable(run, NodePart("localhost", 1, local, rec))
                    assert publish(run, 1, rec) is not None
                    copy_s.append(time.perf_counter() - t0)
                    assert verify(run / "checkpoint-1", True, require_commit=True).ok
                    shutil.rmtree(run)
                    shutil.rmtree(local.parent)
                c = statistics.median(local_s)
                interval = math.sqrt(2 * c * args.mtbf_hours * 3600)
                row = {
                    "size": label,
                    "sync_s": round(statistics.median(sync_s), 3),
                    "local_s": round(c, 3),
                    "ratio": round(c / statistics.median(sync_s), 3),
                    "background_copy_s": round(statistics.median(copy_s), 3),
                    "young_daly_interval_s": round(interval, 1),
                    "overhead_pct": round(100 * c / interval, 3),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            shutil.rmtree(shm_root, ignore_errors=True)
    finally:
        disk.close()
    print(
        f"\n{'size':>6} {'sync save s':>12} {'local save s':>13} {'local/sync':>11} {'copy s (bg)':>12} "
        f"{'Y/D interval s':>15} {'overhead %':>11}"
    )
    for r in rows:
        print(
            f"{r['size']:>6} {r['sync_s']:>12.3f} {r['local_s']:>13.3f} {r['ratio']:>11.3f} "
            f"{r['background_copy_s']:>12.3f} {r['young_daly_interval_s']:>15.1f} {r['overhead_pct']:>11.3f}"
        )
    return rows


# ------------------------------------------------------------------------------------------------ the storm


def part2(args: argparse.Namespace, root: Path) -> dict:
    fx = make_fixtures(root / "fixtures")
    d = root / "storm"
    d.mkdir()
    steps = 3 * args.storm + 10
    recipe = write_recipe(
        d,
        fx,
        peft__r=8,
        peft__target_modules=["q_proj", "v_proj"],
        train__learning_rate=1e-2,
        train__max_steps=steps,
        train__save_steps=10,
        checkpoint__local_dir="auto",
        checkpoint__local_steps=1,
        resilience__max_restarts=args.storm + 2,
    )
    run = d / "run"
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    with mp_lock():
        proc = start_ftkit("launch", str(recipe), env=RUN_ENV, log=d / "launch.log")
        try:
            for attempt in range(args.storm):
                wait_for(lambda a=attempt: heartbeat_step(run, 0, a) >= 0, 300, f"attempt {attempt} trains")
                target = heartbeat_step(run, 0, attempt) + rng.randint(1, 2)
                wait_for(lambda a=attempt, t=target: heartbeat_step(run, 0, a) >= t, 300, "a step", poll=0.02)
                time.sleep(rng.uniform(0, 0.25))
                pid = rank_pid(run, rng.randrange(RANKS), attempt)
                if pid:
                    os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=900)
        finally:
            kill_tree(proc)
    rows = [m for m in read_jsonl(RunDir(run).metrics) if "loss" in m]
    launches = named(run, "launch")[1:]
    recomputed = []
    for e in launches:
        before = [m["step"] for m in rows if m["attempt"] == e["attempt"] - 1]
        recomputed.append(max(0, max(before, default=0) - int(e["step"] or 0)))
    result = {
        "exit": proc.returncode,
        "kills": len(launches),
        "steps": len(losses(run)),
        "recomputed_per_kill": recomputed,
        "mean_recomputed": round(sum(recomputed) / max(1, len(recomputed)), 2),
        "tiers": {t: sum(1 for e in launches if e.get("tier") == t) for t in {e.get("tier") for e in launches}},
        "wall_s": round(time.monotonic() - t0, 1),
        "seed": args.seed,
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit-mbs", type=float, default=240.0)
    ap.add_argument("--mtbf-hours", type=float, default=24.0)
    ap.add_argument("--storm", type=int, default=20)
    ap.add_argument("--skip-storm", action="store_true")
    ap.add_argument("--skip-saves", action="store_true")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ftkit-bench-tiers-", dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    try:
        if not args.skip_saves:
            out["saves"] = part1(args, root)
        if not args.skip_storm:
            out["storm"] = part2(args, root)
    finally:
        (root / "result.json").write_text(json.dumps(out, indent=2))
        print(f"results: {root / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
