"""Synthetic checkpoints: trees laid out as HF Trainer + DeepSpeed (or FSDP2) write them (small deterministic
payloads, no torch), ftkit's commit record over them, damage, and a snapshot of a directory to prove it untouched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ftkit.checkpoint.checksums import DEFAULT_SPEC, SampleSpec
from ftkit.checkpoint.commit import manifest_part, write_commit

MiB = 1024 * 1024


def make_ckpt(
    out: Path,
    step: int,
    *,
    world_size: int = 2,
    stage: int = 2,
    bf16: bool = True,
    model_bytes: int = 1000,
    optim_bytes: int = 700,
    tp: int = 1,
) -> Path:
    """A checkpoint-<step>/ laid out like HF Trainer + DeepSpeed writes it; payloads are deterministic bytes. ``tp``:
    DeepSpeed AutoTP's layout (as a 2-rank tp=2 run wrote it): each TP rank's ``mp_rank_{mp:02d}`` model states, and
    optimizer shards ``zero_pp_rank_{dp}_mp_rank_{mp:02d}`` of global rank ``dp * tp + mp``."""
    ckpt = out / f"checkpoint-{step}"
    tag = f"global_step{step}"
    (ckpt / tag).mkdir(parents=True)

    def put(rel: str, size: int, seed: int = 0) -> None:
        data = bytes((i * 31 + seed + step) % 251 for i in range(min(size, 4096)))
        (ckpt / rel).write_bytes((data * (size // max(len(data), 1) + 1))[:size])

    put("model.safetensors", model_bytes, 1)
    (ckpt / "config.json").write_text(json.dumps({"hidden_size": 64}))
    put("tokenizer.json", 300, 2)
    prefix = "bf16_" if bf16 else ""
    if stage == 3:
        for r in range(world_size):
            put(f"{tag}/zero_pp_rank_{r}_mp_rank_00_model_states.pt", 200 + r, 3)
    else:
        for mp in range(tp):
            put(f"{tag}/mp_rank_{mp:02d}_model_states.pt", 500, 3 + mp)
    if stage > 0 or bf16:
        for r in range(world_size):
            dp, mp = divmod(r, tp)
            put(f"{tag}/{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt", optim_bytes + r, 4 + r)
    (ckpt / "latest").write_text(tag)
    put("zero_to_fp32.py", 120, 9)
    if world_size == 1:
        put("rng_state.pth", 90, 10)
    else:
        for r in range(world_size):
            put(f"rng_state_{r}.pth", 90, 10 + r)
    put("scheduler.pt", 64, 20)
    put("training_args.bin", 64, 21)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return ckpt


def make_dcp_ckpt(out: Path, step: int, *, world_size: int = 2) -> Path:
    """A checkpoint-<step>/ laid out like HF Trainer writes it under FSDP2's sharded state dict: a DCP directory each
    for the model and the optimizer (one ``__R_0.distcp`` per rank, ``.metadata`` from rank 0), RNG per rank."""
    ckpt = out / f"checkpoint-{step}"
    for d in ("pytorch_model_fsdp_0", "optimizer_0"):
        (ckpt / d).mkdir(parents=True)
        (ckpt / d / ".metadata").write_bytes(bytes(range(64)) * 4)
        for r in range(world_size):
            (ckpt / d / f"__{r}_0.distcp").write_bytes(bytes((i + r + step) % 251 for i in range(700 + r)))
    for r in range(world_size):
        (ckpt / (f"rng_state_{r}.pth" if world_size > 1 else "rng_state.pth")).write_bytes(b"r" * (90 + r))
    (ckpt / "scheduler.pt").write_bytes(b"s" * 64)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return ckpt


def commit(
    ckpt: Path,
    *,
    world_size: int = 2,
    stage: int | None = 2,
    spec: SampleSpec = DEFAULT_SPEC,
    checksum: str = "full",
) -> Path:
    step = int(ckpt.name.split("-")[1])
    parts = [manifest_part(ckpt, r, world_size, spec=spec, checksum=checksum) for r in range(world_size)]
    return write_commit(ckpt, parts, step=step, world_size=world_size, stage=stage, recipe_hash="abc123", spec=spec)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def tree(path: Path) -> dict[str, Any]:
    """Every entry under ``path`` with its bytes' hash and mode: equal before and after means untouched."""
    if not path.exists():
        return {}
    out: dict[str, Any] = {".": oct(path.stat().st_mode)}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else oct(p.stat().st_mode)
    return out


def staging_left(parent: Path) -> list[str]:
    """What ``ftkit export`` staged next to its destination and left behind (nothing, when it ends)."""
    return [p.name for p in parent.iterdir() if ".ftkit-export-" in p.name]
