"""A rank's side of the local checkpoint tier (:mod:`ftkit.checkpoint.tiers`): the Trainer saves into this node's
tier directory, each node commits its own part, rank 0 records that every node did, and the node's first rank runs
the node's checkpoint agent (:mod:`ftkit.launch.agent`), which copies due checkpoints to the run directory.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ftkit.checkpoint.commit import CommitError, manifest_part, write_commit
from ftkit.checkpoint.layout import COMMIT_FILE, SAVES_DIR
from ftkit.checkpoint.tiers import (
    CopyError,
    TierUnsafe,
    files_on_node,
    flush_due,
    flush_part,
    local_checkpoints,
    make_private,
    newest_durable,
    node_dir,
    open_tier,
    peer_claims,
    prune_set_records,
    remove_tier,
    rotate_local,
    write_set_record,
)
from ftkit.cluster.procs import proc_start_time
from ftkit.rundir.layout import atomic_write
from ftkit.rundir.spec import LocalTierSpec, RunSpec

if TYPE_CHECKING:
    from transformers import Trainer

    from ftkit.launch.rank import RankContext
    from ftkit.rundir.records import AgentRecord, CommitExtra, FileEntry, MetricsRecord


class NodeTier:
    """This rank's view of its node's tier: where saves go, and (on the node's first rank) the agent."""

    def __init__(self, tier: LocalTierSpec, host: str):
        self.template: str = tier["dir"]
        self.dir = node_dir(self.template, host)
        self.keep = tier["keep"]
        self.durable_steps = tier["durable_steps"]
        self.nodes: list[str] = list(tier["nodes"])
        self.host = host
        self.agent: subprocess.Popen[bytes] | None = None

    def start(self, ctx: RankContext) -> None:
        """The tier directory, made (or checked) private to this user (:func:`open_tier`: a directory another local
        user made or can write to is refused, exit 3), and on the node's first rank its agent (a child: it ends
        with the rank)."""
        try:
            open_tier(self.template, self.host)
        except TierUnsafe as e:
            ctx.record_error(e, repeats=True)
            print(f"ftkit: error: the local checkpoint tier: {e}", file=sys.stderr, flush=True)
            raise SystemExit(e.exit_code) from None
        if ctx.local_rank != 0:
            return
        self._start_agent(ctx)

    def _start_agent(self, ctx: RankContext) -> None:
        self.agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ftkit.launch.agent",
                "run",
                str(ctx.rd.path),
                "--host",
                self.host,
                "--attempt",
                str(ctx.attempt),
                "--parent",
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
        )
        pid = self.agent.pid
        record: AgentRecord = {
            "host": ctx.node_host,
            "pid": pid,
            "start_time": proc_start_time(pid),
            "attempt": ctx.attempt,
            "agent_of_rank": ctx.rank,
        }
        atomic_write(ctx.rd.attempt_dir(ctx.attempt) / "agents" / f"agent-{self.host}.json", json.dumps(record))

    def patch_trainer(self, mod: types.ModuleType) -> None:
        """HF Trainer saves ``checkpoint-N`` under ``_get_output_dir()``: this node's tier directory instead."""
        cls = mod.Trainer
        if getattr(cls._get_output_dir, "_ftkit_tier", False):
            return
        original = cls._get_output_dir
        directory = str(self.dir)

        @functools.wraps(original)
        def _get_output_dir(trainer: Trainer, trial: object = None) -> str:
            return directory if trial is None else original(trainer, trial)

        _get_output_dir._ftkit_tier = True  # type: ignore[attr-defined]
        cls._get_output_dir = _get_output_dir

    def commit(self, ctx: RankContext, spec: RunSpec, step: int, stop: bool) -> MetricsRecord:
        """After the Trainer saved ``checkpoint-<step>`` to every node's tier: each rank checksums its files there,
        each node's first rank commits the node's part, rank 0 records that every node did (the set record), and
        each node rotates its tier. Every rank calls it (two collectives)."""
        import torch.distributed as dist

        ckpt = self.dir / f"checkpoint-{step}"
        t0 = time.time()
        multi = len(self.nodes) > 1
        first = ctx.rank - ctx.local_rank
        files = files_on_node(ckpt, ctx.rank, first) if multi else None
        part = manifest_part(ckpt, ctx.rank, ctx.world_size, checksum=spec.resilience.checksum, files=files)
        parts: list[tuple[int, str, dict[str, FileEntry]]] = [(ctx.rank, self.host, part)]
        if dist.is_available() and dist.is_initialized():
            parts = cast("list[tuple[int, str, dict[str, FileEntry]]]", [None] * ctx.world_size)  # filled below
            dist.all_gather_object(parts, (ctx.rank, self.host, part))  # every rank finished writing
        mine = [p for r, h, p in sorted(parts) if h == self.host]
        extra: CommitExtra = {
            "attempt": ctx.attempt,
            "fingerprint": spec.fingerprint,
            "tier": "local",
            "node": self.host,
            "nodes": self.nodes,
            "ranks": sorted(r for r, h, _ in parts if h == self.host),
            "stop": stop or None,
        }
        if ctx.local_rank == 0:
            make_private(ckpt)  # every rank finished writing (the gather): the node's files, 0600
            if self.agent is not None and self.agent.poll() is not None:  # died (killed, out of memory): again
                print(
                    f"ftkit: the checkpoint agent on {self.host} ended ({self.agent.returncode}): restarted", flush=True
                )
                self._start_agent(ctx)
            write_commit(
                ckpt,
                mine,
                step=step,
                world_size=ctx.world_size,
                stage=spec.stage,
                recipe_hash=spec.recipe_hash,
                extra=extra,
                kind="node" if multi else "checkpoint",
            )
            os.chmod(ckpt / COMMIT_FILE, 0o600)
            saves = self.dir / SAVES_DIR
            if saves.is_dir():
                make_private(saves)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every node's part is committed
        commit_s = round(time.time() - t0, 3)
        if ctx.rank == 0:
            write_set_record(
                ctx.rd.path, step, attempt=ctx.attempt, nodes=self.nodes, world_size=ctx.world_size, stop=stop or None
            )
        removed: list[str] = []
        if ctx.local_rank == 0:
            try:
                removed = [
                    p.name
                    for p in rotate_local(
                        self.dir,
                        self.keep,
                        self.durable_steps,
                        newest_durable(ctx.rd.path),
                        claimed=peer_claims(ctx.rd.path, self.host),
                    )
                ]
            except OSError as e:
                print(f"ftkit: warning: local tier rotation stopped: {e}", flush=True)
        if ctx.rank == 0:  # a set record lives as long as rank 0's node keeps its part (rotation kept those that
            # pair with peer copies too), so a peer copy that arrives late still finds its set
            held = {s for s, _, _ in local_checkpoints(self.dir)}
            prune_set_records(ctx.rd.path, self.keep, self.durable_steps, protect=held)
        return {"tier": "local", "commit_s": commit_s, "rotated": removed}

    def end_orphaned(self, ctx: RankContext, spec: RunSpec) -> None:
        """The ranks finished the run while its supervisor was gone (an orphan-finished run): nobody else ends this
        node's tier, which would stay in /dev/shm (tens of GB on a real model). The node's first rank stops its
        agent, copies its part of what the end of a launch copies (:func:`flush_due`: the last node to copy
        publishes each step), then removes what ftkit made of the tier."""
        if ctx.local_rank != 0 or not spec.local_tier:
            return
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            try:
                self.agent.wait(10)
            except subprocess.TimeoutExpired:
                self.agent.kill()
        try:
            for rec in flush_due(ctx.rd.path, spec.local_tier):
                if self.host in (rec.get("nodes") or []):
                    ok, why, _ = flush_part(ctx.rd.path, self.dir, self.host, rec["step"])
                    if not ok:
                        print(f"ftkit: warning: step {rec['step']} not copied to the run directory: {why}", flush=True)
            kept = remove_tier(self.template, self.host)
        except (OSError, TierUnsafe, CopyError, CommitError) as e:
            print(f"ftkit: warning: the local tier on {self.host} was not removed: {e}", flush=True)
            return
        print(f"ftkit: removed the local tier {self.dir}" + (f" (kept {'; '.join(kept)})" if kept else ""), flush=True)

    def wait_durable(self, run_dir: Path, step: int, timeout_s: float) -> bool:
        """A graceful stop's save: wait (bounded) until the agents made it durable in the run directory."""
        record = run_dir / f"checkpoint-{step}" / COMMIT_FILE
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if record.is_file():
                return True
            time.sleep(0.2)
        return False


def local_tier(spec: RunSpec, ctx: RankContext) -> NodeTier | None:
    """This rank's node tier, None when the run has none (every save goes to the run directory)."""
    return NodeTier(spec.local_tier, ctx.node_host) if spec.local_tier else None


def dir_of(tier: NodeTier | None, output_dir: str) -> Path:
    return tier.dir if tier is not None else Path(output_dir)
