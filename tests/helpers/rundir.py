"""Rank files written by hand, as the ranks write them: for tests of what the supervisor and ``ftkit status`` read."""

from __future__ import annotations

import json
import time
from pathlib import Path

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


def write_spec(
    run: Path,
    *,
    name: str = "synthetic",
    stage: int = 2,
    precision: str = "fp32",
    nodes: list[str] | None = None,
    local_tier: dict[str, object] | None = None,
) -> RunDir:
    """A run directory holding only a spec (2 CPU ranks on each of ``nodes``, default one localhost) and the recipe
    record beside it (``ftkit/recipe.json``), for tests that read a run's spec without running it."""
    from ftkit.recipe.schema import SECTION_BY_NAME
    from ftkit.rundir.sections import ResilienceSection
    from ftkit.rundir.spec import DataSpec, RunSpec

    resilience = ResilienceSection(**{f.name: f.default for f in SECTION_BY_NAME["resilience"].fields})
    hosts = [[n, 2] for n in (nodes or ["localhost"])]
    spec = RunSpec(
        ftkit_version="test",
        name=name,
        recipe_hash="abc123",
        world_size=2 * len(hosts),
        hosts=hosts,
        stage=stage,
        offload_optimizer="none",
        offload_params="none",
        accelerator="cpu",
        backend="deepspeed",
        precision=precision,
        resilience=resilience,
        model_path=str(run.parent / "model"),
        tokenizer_path=str(run.parent / "model"),
        model_revision=None,
        tokenizer_revision=None,
        peft=None,
        data=DataSpec(train="data.jsonl", max_seq_len=64, truncate=False),
        save_total_limit=2,
        training_args={},
        fingerprint={},
        **({"local_tier": local_tier} if local_tier is not None else {}),
    )
    rd = RunDir(run)
    rd.meta.mkdir(parents=True, exist_ok=True)
    rd.spec.write_text(spec.to_json())
    rd.recipe.write_text(json.dumps({"train": {"precision": precision}}))
    return rd


def tier_run(run: Path, template: str, nodes: list[str], durable_steps: int = 5, keep: int = 2) -> RunDir:
    """A run directory whose spec names a local checkpoint tier (what ``ftkit.launch.agent`` and the supervisor's
    tier functions read of it); no process runs."""
    tier = {
        "dir": template,
        "steps": 1,
        "keep": keep,
        "peer_copies": 0,
        "bytes_per_node": 0,
        "host_gb_per_node": 0.0,
        "why": "test",
        "durable_steps": durable_steps,
        "nodes": nodes,
        "ssh_config": None,
    }
    return write_spec(run, name="tiered", nodes=nodes, local_tier=tier)
