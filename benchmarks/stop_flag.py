"""What the graceful-stop agreement costs per optimizer step: ``StopRequest.agreed`` (one stat of ``stop.json``
and one all-reduce of a 1-element int tensor) on 2 real CPU ranks with gloo, the way every rank calls it at every
step end (:mod:`ftkit.hf`).

    python benchmarks/stop_flag.py [--iters 2000]

Prints the median and 99th percentile per call, on rank 0, and the same for a bare ``os.path.exists``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _rank(rank: int, world: int, port: int, run_dir: str, iters: int, out: str) -> None:
    import torch.distributed as dist

    from ftkit.launch.rank import StopRequest
    from ftkit.rundir.layout import RunDir

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    req = StopRequest(RunDir(run_dir), attempt=0)
    for _ in range(50):  # warm-up
        req.agreed()
    agreed, stat = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        req.agreed()
        agreed.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        req.path.exists()
        stat.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q = statistics.quantiles
        Path(out).write_text(
            f"agreed (stat + all-reduce): median {statistics.median(agreed) * 1e6:.0f} us, "
            f"p99 {q(agreed, n=100)[98] * 1e6:.0f} us over {iters} calls\n"
            f"stat alone: median {statistics.median(stat) * 1e6:.1f} us\n"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "ftkit").mkdir()
        out = str(Path(d) / "result.txt")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, 2, port, d, args.iters, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        if any(p.exitcode != 0 for p in procs):
            print("a rank failed", file=sys.stderr)
            return 1
        print(Path(out).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
