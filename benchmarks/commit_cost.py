"""What do ftkit's full-content checksums cost: at save (the commit) and at resume (verification)?

Why: every checkpoint file is hashed over its whole content (XXH3-128) right after the save and re-read against
that hash before a resume, so a same-size corrupted shard can never resume as "verified". The commit runs on the
critical path of training after every save and must stay a small share of the save (target <= 3%); verification
runs before every restart and must stay short next to the restart itself.

1. Hash speed, in memory (no I/O), one thread: xxh3_128 (the default), blake2b (the full checksum of commit
   records version 1) and blake3 when it is installed. Picks the algorithm, and bounds what hashing can cost.
2. For each ``--sizes`` (GiB): write a synthetic ``checkpoint-100/`` laid out like HF Trainer + DeepSpeed
   (``--shards`` optimizer shards, one per rank, carrying the bulk; model states, RNG files, trainer state) with
   real writes and an fsync per file, as a save that claims durability must; that is the "save". Then, as
   ``launch/train.py`` does, right after the save with the data still in the page cache:

   * commit: ``manifest_part`` for every rank (here one after another, in a real job in parallel, so the share
     of the save is the same: the save's writes are spread over the ranks alike) + ``write_commit``;
   * verify on resume with every byte checked (``verify`` with defaults, what ``select_resume`` does), once with
     the page cache dropped for the files (``posix_fadvise(DONTNEED)``, "cold": a restart on a node that did not
     write them, or long after) and once warm (a restart on the node that just wrote them); and sizes only;
   * for comparison, the opt-in sampled commit (``resilience.checksum: sampled``).

Usage: ``python benchmarks/commit_cost.py [--sizes 2 8] [--shards 8] [--dir /fast/disk]``. Needs free disk and
ideally free memory of the largest size (the warm numbers assume the checkpoint fits in the page cache).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import xxhash  # noqa: E402

from ftkit.checkpoint.commit import manifest_part, write_commit
from ftkit.checkpoint.verify import verify

CHUNK = 16 * 1024 * 1024


def hash_speeds(mib: int = 512) -> dict[str, float]:
    """GB/s (10^9 bytes) of each algorithm over ``mib`` MiB already in memory, one thread, best of 3."""
    buf = os.urandom(64 * 1024 * 1024)
    algos: dict[str, Callable[[], Any]] = {
        "xxh3_128": xxhash.xxh3_128,
        "blake2b": lambda: hashlib.blake2b(digest_size=16),
    }
    try:
        import blake3  # type: ignore[import-not-found]

        algos["blake3"] = blake3.blake3
    except ImportError:
        pass
    out = {}
    for name, make in algos.items():
        rounds = max(1, mib // 64) if name != "blake2b" else max(1, mib // 256)  # blake2b is ~10x slower
        best = float("inf")
        for _ in range(3):
            h = make()
            t = time.perf_counter()
            for _ in range(rounds):
                h.update(buf)
            h.digest()
            best = min(best, time.perf_counter() - t)
        out[name] = rounds * len(buf) / best / 1e9
    return out


def _write(path: Path, size: int, pattern: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb", buffering=0) as f:
        left = size
        i = 0
        while left:
            n = min(left, CHUNK)
            # vary each chunk so no filesystem could deduplicate or compress the writes away
            f.write(i.to_bytes(8, "little") + pattern[8:n])
            left -= n
            i += 1
        os.fsync(f.fileno())


def _evict(root: Path) -> None:
    """Drop the files' clean pages from the page cache so the next reads come from disk."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def make_checkpoint(root: Path, size: int, shards: int) -> Path:
    step = 100
    ckpt = root / f"checkpoint-{step}"
    tag = f"global_step{step}"
    pattern = os.urandom(CHUNK)
    shard_bytes = size // shards
    for r in range(shards):
        _write(ckpt / tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", shard_bytes, pattern)
    _write(ckpt / tag / "mp_rank_00_model_states.pt", 4 * 1024 * 1024, pattern)
    for r in range(shards):
        _write(ckpt / f"rng_state_{r}.pth", 15 * 1024, pattern)
    for name, n in [("scheduler.pt", 1064), ("training_args.bin", 5432), ("zero_to_fp32.py", 30_000)]:
        _write(ckpt / name, n, pattern)
    (ckpt / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    (ckpt / "latest").write_text(tag)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    for d in (ckpt / tag, ckpt, root):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)
    return ckpt


def _commit(ckpt: Path, shards: int, checksum: str) -> tuple[float, float]:
    """(all ranks in series + record, slowest rank + record): a job's ranks hash in parallel on their own cores."""
    per_rank, parts = [], []
    for r in range(shards):
        t = time.perf_counter()
        parts.append(manifest_part(ckpt, r, shards, checksum=checksum))
        per_rank.append(time.perf_counter() - t)
    t = time.perf_counter()
    write_commit(ckpt, parts, step=100, world_size=shards, stage=2, recipe_hash="bench")
    record_s = time.perf_counter() - t
    return sum(per_rank) + record_s, max(per_rank) + record_s


def _timed_verify(ckpt: Path, checksums: bool) -> float:
    t = time.perf_counter()
    v = verify(ckpt, checksums)
    elapsed = time.perf_counter() - t
    if not v.ok:
        raise SystemExit(f"benchmark checkpoint did not verify: {v.reason}")
    return elapsed


def run(size_gib: float, shards: int, base: Path) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="ftkit-commit-bench-", dir=base))
    try:
        size = int(size_gib * 1024**3)
        t0 = time.perf_counter()
        ckpt = make_checkpoint(root, size, shards)
        save_s = time.perf_counter() - t0
        commit_s, commit_max_s = _commit(ckpt, shards, "full")  # right after the save: data in the page cache
        out = {"size_gib": size / 1024**3, "save_s": save_s, "commit_s": commit_s, "commit_max_s": commit_max_s}
        _evict(root)
        out["verify_cold_s"] = _timed_verify(ckpt, True)
        out["verify_warm_s"] = _timed_verify(ckpt, True)
        out["verify_sizes_s"] = _timed_verify(ckpt, False)
        out["commit_sampled_s"] = _commit(ckpt, shards, "sampled")[0]
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[2.0, 8.0], help="checkpoint sizes in GiB (2 8)")
    ap.add_argument("--shards", type=int, default=8, help="optimizer shard files = simulated ranks (default 8)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write (default: tmp)")
    ap.add_argument("--no-hash-speed", action="store_true", help="skip the in-memory hash speed table")
    args = ap.parse_args(argv)

    if not args.no_hash_speed:
        speeds = hash_speeds()
        print("hash speed, in memory, one thread (GB/s):")
        print(_table([list(speeds), [f"{v:.2f}" for v in speeds.values()]]))
        if "blake3" not in speeds:
            print("(blake3 not installed: pip install blake3 to compare)")
        print()

    rows = [
        [
            "size GiB",
            "save s",
            "commit s",
            "% of save",
            "max rank s",
            "% of save",
            "verify cold s",
            "verify cold GB/s",
            "verify warm s",
            "verify sizes s",
            "sampled commit s",
        ]
    ]
    for size in args.sizes:
        r = run(size, args.shards, args.dir)
        rows.append(
            [
                f"{r['size_gib']:.2f}",
                f"{r['save_s']:.2f}",
                f"{r['commit_s']:.3f}",
                f"{100 * r['commit_s'] / r['save_s']:.2f}",
                f"{r['commit_max_s']:.3f}",
                f"{100 * r['commit_max_s'] / r['save_s']:.2f}",
                f"{r['verify_cold_s']:.2f}",
                f"{r['size_gib'] * 1024**3 / r['verify_cold_s'] / 1e9:.2f}",
                f"{r['verify_warm_s']:.2f}",
                f"{r['verify_sizes_s']:.4f}",
                f"{r['commit_sampled_s']:.3f}",
            ]
        )
    print(
        f"commit = full xxh3_128 manifests of {args.shards} ranks + record (in series: one core does all the "
        "hashing; max rank: ranks hash in parallel, as in a job); save = writes with fsync"
    )
    print(_table(rows))
    print("(commit right after the save, data in the page cache; verify cold: page cache dropped for the files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
