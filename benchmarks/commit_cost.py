"""How much does ftkit's checkpoint commit cost compared with the save itself?

Why: the commit (per-rank manifest with fsync + sampled checksums, then the atomic record) runs after every
save, on the critical path of training. It must stay a small fraction of the save for big checkpoints, and
resume-time verification must stay cheap enough for the supervisor to run before every relaunch.

The benchmark writes a synthetic ``checkpoint-100/`` laid out like HF Trainer + DeepSpeed (``--shards``
optimizer shards, one per rank, carrying the bulk of ``--size-gb``; plus model states, RNG files, trainer
state), with real writes and fsync so the save time is what a disk really takes. Then it times, with the page
cache dropped for the files (``posix_fadvise(DONTNEED)``, no root needed) so reads hit the disk:

* commit: ``manifest_part`` for every rank (run one after another here; in a real job they run in parallel,
  so the "max rank" column is the wall time a job would see) + ``write_commit``;
* verify (sizes only), the supervisor's default; verify with sampled checksums; and a thorough commit/verify
  with full checksums (``--thorough``).

Usage: ``python benchmarks/commit_cost.py --size-gb 2 [--shards 8] [--dir /fast/disk] [--no-save-fsync]``.
``--no-save-fsync`` writes like torch.save does (no fsync), so the commit's own fsync pays the writeback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftkit.checkpoints import manifest_part, verify, write_commit  # noqa: E402

CHUNK = 16 * 1024 * 1024


def _write(path: Path, size: int, pattern: bytes, fsync: bool) -> None:
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
        if fsync:
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


def make_checkpoint(root: Path, size: int, shards: int, fsync: bool) -> Path:
    step = 100
    ckpt = root / f"checkpoint-{step}"
    tag = f"global_step{step}"
    pattern = os.urandom(CHUNK)
    shard_bytes = size // shards
    for r in range(shards):
        _write(ckpt / tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", shard_bytes, pattern, fsync)
    _write(ckpt / tag / "mp_rank_00_model_states.pt", 4 * 1024 * 1024, pattern, fsync)
    for r in range(shards):
        _write(ckpt / f"rng_state_{r}.pth", 15 * 1024, pattern, fsync)
    for name, n in [("scheduler.pt", 1064), ("training_args.bin", 5432), ("zero_to_fp32.py", 30_000)]:
        _write(ckpt / name, n, pattern, fsync)
    (ckpt / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    (ckpt / "latest").write_text(tag)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    if fsync:
        for d in (ckpt / tag, ckpt, root):
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(fd)
            os.close(fd)
    return ckpt


def run(size_gb: float, shards: int, base: Path, save_fsync: bool, thorough: bool) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="ftkit-commit-bench-", dir=base))
    try:
        size = int(size_gb * 1024**3)
        t0 = time.perf_counter()
        ckpt = make_checkpoint(root, size, shards, save_fsync)
        save_s = time.perf_counter() - t0
        if save_fsync:
            _evict(root)  # without save fsync the data is still dirty: leave it, the commit must flush it

        per_rank = []
        parts = []
        for r in range(shards):
            t = time.perf_counter()
            parts.append(manifest_part(ckpt, r, shards))
            per_rank.append(time.perf_counter() - t)
        t = time.perf_counter()
        write_commit(ckpt, parts, step=100, world_size=shards, stage=2, recipe_hash="bench")
        record_s = time.perf_counter() - t

        _evict(root)
        t = time.perf_counter()
        v = verify(ckpt)
        verify_sizes_s = time.perf_counter() - t
        assert v.ok, v.reason
        _evict(root)
        t = time.perf_counter()
        v = verify(ckpt, checksums=True)
        verify_sampled_s = time.perf_counter() - t
        assert v.ok, v.reason

        out = {
            "size_gib": size / 1024**3,
            "save_s": save_s,
            "commit_sum_s": sum(per_rank) + record_s,
            "commit_max_s": max(per_rank) + record_s,
            "verify_sizes_s": verify_sizes_s,
            "verify_sampled_s": verify_sampled_s,
        }
        if thorough:
            _evict(root)
            t = time.perf_counter()
            parts = [manifest_part(ckpt, r, shards, thorough=True) for r in range(shards)]
            write_commit(ckpt, parts, step=100, world_size=shards, stage=2, recipe_hash="bench")
            out["commit_full_s"] = time.perf_counter() - t
            _evict(root)
            t = time.perf_counter()
            v = verify(ckpt, checksums=True)
            out["verify_full_s"] = time.perf_counter() - t
            assert v.ok, v.reason
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="total checkpoint size in GiB (default 2)")
    ap.add_argument("--shards", type=int, default=8, help="optimizer shard files = simulated ranks (default 8)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write (default: tmp)")
    ap.add_argument("--no-save-fsync", action="store_true", help="save without fsync, like torch.save")
    ap.add_argument("--thorough", action="store_true", help="also time a full-checksum commit and verify")
    args = ap.parse_args(argv)

    r = run(args.size_gb, args.shards, args.dir, not args.no_save_fsync, args.thorough)
    cols = [
        ("size GiB", f"{r['size_gib']:.2f}"),
        ("save s", f"{r['save_s']:.2f}"),
        ("commit s (ranks in series)", f"{r['commit_sum_s']:.3f}"),
        ("commit s (max rank)", f"{r['commit_max_s']:.3f}"),
        ("ratio %", f"{100 * r['commit_sum_s'] / r['save_s']:.2f}"),
        ("verify sizes s", f"{r['verify_sizes_s']:.4f}"),
        ("verify sampled s", f"{r['verify_sampled_s']:.3f}"),
    ]
    if "commit_full_s" in r:
        cols += [("commit full s", f"{r['commit_full_s']:.2f}"), ("verify full s", f"{r['verify_full_s']:.2f}")]
    widths = [max(len(h), len(v)) for h, v in cols]
    print(" | ".join(h.rjust(w) for (h, _), w in zip(cols, widths, strict=True)))
    print(" | ".join(v.rjust(w) for (_, v), w in zip(cols, widths, strict=True)))
    print(f"(save fsync: {'off' if args.no_save_fsync else 'on'}; page cache dropped before each timed read)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
