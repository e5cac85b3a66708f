"""The checkpoint agent of one node: copies the node's committed local-tier checkpoints to the run directory in the
background (and to the next node's tier with ``peer_copies: 1``), so a durable save never blocks the ranks.

``python -m ftkit.launch.agent run RUN_DIR --host H --attempt N``: started by the node's first rank with the attempt
(its child: torn down with it), it looks every :data:`POLL_S` for local checkpoints that are due in the run directory
(every ``train.save_steps``, and a graceful stop's save), copies this node's part, hashing every byte, and publishes
the step once every node's part is there (:mod:`ftkit.checkpoint.tiers`). It ends when its rank does.

One-shot commands the supervisor runs on every host (``ftkit.cluster.fanout``), each printing one JSON line:

* ``verify RUN_DIR --host H --step N``: this node's part of step N, every byte against its record;
* ``flush RUN_DIR --host H --step N``: this node's part of step N copied now (the end of a launch: the local tier
  is about to be removed);
* ``assemble RUN_DIR --host H --step N --lost A,B``: step N into the run directory from this node's part and the
  peer copies it holds of the lost nodes' parts;
* ``clean RUN_DIR --host H``: the run's local tier on this node, removed.

Standard library and xxhash only (the controller's contract folders).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit.checkpoint.directory import rotate
from ftkit.checkpoint.layout import COMMIT_FILE, DURABLE_MARK, PEER_MARK, PEER_SENDING
from ftkit.checkpoint.tiers import (
    CopyError,
    NodePart,
    TierUnsafe,
    claim_peer_copy,
    copy_to_durable,
    copy_to_peer,
    discard_newer,
    flush_part,
    local_checkpoints,
    newest_durable,
    node_dir,
    open_tier,
    peer_parts,
    publish,
    remove_tier,
    rotate_peer_copies,
    verify_part,
)
from ftkit.cluster.hosts import is_local
from ftkit.rundir.layout import RunDir, append_jsonl
from ftkit.rundir.spec import LocalTierSpec, RunSpec

if TYPE_CHECKING:
    from ftkit.rundir.records import CommitRecord

POLL_S = 0.5
# Test-only: seconds the agent waits after copying each file, so a test can kill it in the middle of a copy (the
# moment is chosen; the copy and the kill are real). Like FTKIT_FAULT_INJECT, never set in production.
PAUSE_ENV = "FTKIT_AGENT_PAUSE_S"


def _tier(run_dir: str) -> tuple[RunSpec, LocalTierSpec]:
    spec = RunSpec.read(RunDir(run_dir).spec)
    if not spec.local_tier:
        raise SystemExit("ftkit agent: this run has no local checkpoint tier")
    return spec, spec.local_tier


def _due(step: int, record: CommitRecord, every: int) -> bool:
    return step % every == 0 or bool((record.get("extra") or {}).get("stop"))


def _send(ssh_config: str | None, host: str) -> Callable[[Path, Path], None]:
    """Copy a directory to ``host``'s file system over ssh (tar through one session), atomically there."""

    def send(src: Path, dst: Path) -> None:
        tmp = dst.with_name(f".{dst.name}.tmp")
        remote = (
            f"rm -rf {shlex.quote(str(tmp))} && mkdir -p {shlex.quote(str(tmp))} && tar -C {shlex.quote(str(tmp))} "
            f"-xf - && rm -rf {shlex.quote(str(dst))} && mv {shlex.quote(str(tmp))} {shlex.quote(str(dst))}"
        )
        ssh = ["ssh", "-o", "BatchMode=yes", *(["-F", ssh_config] if ssh_config else []), "--", host, remote]
        tar = subprocess.Popen(["tar", "-C", str(src), "-cf", "-", "."], stdout=subprocess.PIPE)
        done = subprocess.run(ssh, stdin=tar.stdout, capture_output=True, timeout=600)
        tar.wait()
        if done.returncode != 0 or tar.returncode != 0:
            raise CopyError(f"peer copy to {host} failed: {done.stderr.decode(errors='replace').strip()[-300:]}")

    return send


class Agent:
    def __init__(self, run_dir: str, host: str, attempt: int):
        self.rd = RunDir(run_dir)
        self.spec, self.tier = _tier(run_dir)
        self.host, self.attempt = host, attempt
        self.dir = node_dir(self.tier["dir"], host)
        nodes = list(self.tier["nodes"])
        self.peer = nodes[(nodes.index(host) + 1) % len(nodes)] if host in nodes and len(nodes) > 1 else None
        self.done: set[int] = set()

    def say(self, event: str, **data: object) -> None:
        append_jsonl(
            self.rd.metrics, {"event": event, "host": self.host, "attempt": self.attempt, **data, "time": time.time()}
        )

    def pending(self) -> list[NodePart]:
        """Committed local parts due in the run directory and not there yet, oldest first (all of them: copying only
        the newest let a lagging copier skip a due step for good)."""
        durable = newest_durable(self.rd.path)
        out = []
        for step, path, rec in local_checkpoints(self.dir):
            if step in self.done or (path / DURABLE_MARK).exists():
                continue
            if durable is not None and step <= durable:
                (path / DURABLE_MARK).touch()
                continue
            if _due(step, rec, int(self.tier["durable_steps"])):
                out.append(NodePart(self.host, step, path, rec))
        # every due one, oldest first: each is a save the recipe asked to be durable (rotation keeps them meanwhile)
        return sorted(out, key=lambda p: p.step)

    def copy(self, part: NodePart) -> None:
        t0 = time.time()
        pause = float(os.environ.get(PAUSE_ENV) or 0)
        copied = copy_to_durable(self.rd.path, part, (lambda _rel: time.sleep(pause)) if pause else None)
        published = publish(self.rd.path, part.step, part.record)
        if published is not None:
            keep = self.spec.save_total_limit
            if keep:
                rotate(self.rd.path, keep)
        (part.path / DURABLE_MARK).touch()  # this node's part is in the run directory (published by someone)
        self.done.add(part.step)
        size = sum(int(e["size"]) for e in copied.values())
        self.say("durable", step=part.step, bytes=size, copy_s=round(time.time() - t0, 3), published=bool(published))

    def peer_copy(self) -> None:
        if not self.peer or not self.tier["peer_copies"]:
            return
        if is_local(self.peer):  # its tier is a path here: written into only when it is that node's own, private
            try:
                if open_tier(self.tier["dir"], self.peer, create=False) is None:
                    return
            except TierUnsafe as e:
                print(f"ftkit agent on {self.host}: no peer copy: {e}", file=sys.stderr, flush=True)
                return
        held = {s for s, _ in peer_parts(node_dir(self.tier["dir"], self.peer), self.host)}
        for step, path, rec in local_checkpoints(self.dir)[:1]:
            if step in held or step in getattr(self, "_peered", set()):
                continue
            try:  # rotation keeps the part while it is copied (peer_protected); it may have gone just now
                (path / PEER_SENDING).touch()
            except FileNotFoundError:
                continue
            if not (path / COMMIT_FILE).is_file():
                continue
            send = None if is_local(self.peer) else _send(self.tier["ssh_config"], self.peer)
            t0 = time.time()
            try:  # a claim or copy that fails (the run directory unwritable, ssh down) leaves no mark behind
                claim_peer_copy(self.rd.path, self.host, self.peer, step)  # the peer keeps its own part of it
                copy_to_peer(NodePart(self.host, step, path, rec), node_dir(self.tier["dir"], self.peer), send)
                (path / PEER_MARK).touch()  # the copy pairs with this part: rotation keeps the newest such
            finally:
                (path / PEER_SENDING).unlink(missing_ok=True)
            self._peered = getattr(self, "_peered", set()) | {step}
            self.say("peer_copy", step=step, to=self.peer, copy_s=round(time.time() - t0, 3))

    def run(self, parent: int) -> int:
        while os.getppid() == parent:
            try:
                for part in self.pending():
                    self.copy(part)
                self.peer_copy()
                rotate_peer_copies(self.dir)
            except (CopyError, OSError) as e:  # a torn local part, a full disk: say so, try the next one
                print(f"ftkit agent on {self.host}: {e}", file=sys.stderr, flush=True)
            time.sleep(POLL_S)
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftkit.launch.agent", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("run", "verify", "flush", "assemble", "clean"))
    ap.add_argument("run_dir")
    ap.add_argument("--host", required=True)
    ap.add_argument("--attempt", type=int, default=-1)
    ap.add_argument("--step", type=int)
    ap.add_argument("--lost", default="")
    ap.add_argument("--parent", type=int, default=0)
    ap.add_argument("--newer-than", type=int, help="clean: only the parts of later steps (-1: every step)")
    a = ap.parse_args(argv)
    if a.command == "clean":
        spec = RunSpec.read(RunDir(a.run_dir).spec)
        template = spec.local_tier["dir"] if spec.local_tier else ""
        try:
            if template and a.newer_than is not None:  # before an attempt: the tier made (or checked) private
                d = open_tier(template, a.host)
                gone = discard_newer(d, None if a.newer_than < 0 else a.newer_than) if d is not None else []
                print(json.dumps({"host": a.host, "ok": True, "discarded": sorted(p.name for p in gone)}))
                return 0
            kept = remove_tier(template, a.host) if template else []
        except TierUnsafe as e:
            print(json.dumps({"host": a.host, "ok": False, "unsafe": True, "reason": str(e)}))
            return 0
        where = str(node_dir(template, a.host)) if template else None
        print(json.dumps({"host": a.host, "ok": True, "cleaned": where, "kept": kept}))
        return 0
    agent = Agent(a.run_dir, a.host, a.attempt)
    try:  # ownership checked again at every resume, flush and assembly: nothing is read from a tier not ours alone
        if a.command != "run" and open_tier(agent.tier["dir"], a.host, create=False) is None:
            print(json.dumps({"host": a.host, "ok": False, "reason": f"no local tier at {agent.dir}"}))
            return 0
    except TierUnsafe as e:
        print(json.dumps({"host": a.host, "ok": False, "unsafe": True, "reason": str(e)}))
        return 0
    if a.command == "run":
        return agent.run(a.parent or os.getppid())
    if a.command == "verify":
        path = agent.dir / f"checkpoint-{a.step}"
        v = verify_part(path)
        print(json.dumps({"host": a.host, "ok": v.ok, "reason": v.reason}))
        return 0
    if a.command == "flush":
        ok, why, made = flush_part(agent.rd.path, agent.dir, a.host, a.step)
        print(json.dumps({"host": a.host, "ok": ok, "reason": why, "published": made}))
        return 0
    # assemble
    own = agent.dir / f"checkpoint-{a.step}"
    parts = []
    wanted = [(a.host, own)]
    for lost in filter(None, a.lost.split(",")):
        copy = dict(peer_parts(agent.dir, lost)).get(a.step)
        if copy is None:
            held = sorted(s for s, _ in peer_parts(agent.dir, lost))
            print(
                json.dumps(
                    {
                        "host": a.host,
                        "ok": False,
                        "reason": f"no peer copy of step {a.step} of {lost} here (it holds {held or 'none'})",
                    }
                )
            )
            return 0
        wanted.append((lost, copy))
    for host, path in wanted:
        v = verify_part(path)
        if not v.ok:
            print(json.dumps({"host": a.host, "ok": False, "reason": f"{host}'s part: {v.reason}"}))
            return 0
        parts.append(NodePart(host, a.step, path, v.record or {}))
    for part in parts:
        copy_to_durable(agent.rd.path, part)
    published = publish(agent.rd.path, a.step, parts[0].record)
    done = published is not None or (agent.rd.path / f"checkpoint-{a.step}" / COMMIT_FILE).is_file()
    print(json.dumps({"host": a.host, "ok": done, "reason": None if done else "parts of other nodes missing"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
