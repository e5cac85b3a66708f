"""One attempt's processes: start the engine's commands, and stop everything of the attempt on every host.

* :func:`spawn` starts each node's command in its own session (its log under ``logs/attempt-N/``) and records a
  ``spawn`` event with the launcher's pid and start time (``ftkit stop --force`` and ``--takeover`` find it by them);
* :func:`teardown_attempt` stops the whole attempt: the spawned process groups and every recorded rank and agent
  pid on every host (SIGTERM + SIGCONT, grace, SIGKILL, verify: :func:`ftkit.cluster.procs.teardown`), waits until the
  orphaned ranks are reaped, and only then removes the run's /dev/shm buffers. The supervisor calls it in a
  ``finally``: no exception between spawn and teardown leaves ranks holding the GPUs.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit.cluster.procs import (
    agent_targets,
    group_exists,
    proc_start_time,
    remove_shm,
    targets_from_records,
    teardown,
)
from ftkit.command.engines import LaunchCommand
from ftkit.rundir.layout import RunDir, atomic_write
from ftkit.rundir.records import EventSink

if TYPE_CHECKING:
    from ftkit.cluster.fanout import Transport


@dataclass
class Spawned:
    node_rank: int
    host: str
    proc: subprocess.Popen[bytes]
    log: Path


def spawn(cmd: LaunchCommand, attempt: int, rd: RunDir, events: EventSink, out: list[Spawned]) -> None:
    """Start every node's process; each is appended to ``out`` as it starts (teardown needs even a partial list)."""
    for path, text in cmd.files.items():
        atomic_write(Path(path), text, mode=0o600)  # DeepSpeed's env file holds the environment's values
    log_dir = rd.log_dir(attempt)
    log_dir.mkdir(parents=True, exist_ok=True)
    for node in cmd.nodes:
        log = log_dir / f"launcher-node{node.node_rank}.log"
        with open(log, "ab") as fh:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                list(node.argv),
                env=dict(node.env) if node.env else None,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=str(rd.path.parent),
            )
        out.append(Spawned(node.node_rank, node.host, proc, log))
        events(
            "spawn",
            None,
            node=node.node_rank,
            host=node.host,
            pid=proc.pid,
            start_time=proc_start_time(proc.pid),  # ftkit stop --force and --takeover find the launcher by it
            remote=node.remote,
            argv=cmd.redactor.argv(node.argv),  # an ssh line carries the environment inline: secrets masked
        )


def teardown_attempt(
    procs: list[Spawned],
    attempt: int,
    rd: RunDir,
    events: EventSink,
    *,
    grace_s: float,
    ssh_args: list[str],
    transport: Transport | None = None,
) -> None:
    """Stop every process of the attempt on every host and record the outcome (a ``teardown`` event)."""
    groups = [p.proc.pid for p in procs]  # the group may outlive its leader
    records = rd.records("pids", attempt)
    res = teardown(
        sorted(set(groups)),
        targets_from_records(records) + agent_targets(rd.records("agents", attempt)),
        grace_s=grace_s,
        ssh_args=ssh_args,
        transport=transport,
    )
    for p in procs:
        try:
            p.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    # Ranks orphaned by their agent's death are zombies until init reaps them, a moment later; until then
    # killpg(group, 0) still finds them. Wait for that, so that when ftkit returns nothing of the run is left.
    end = time.monotonic() + 5.0
    while time.monotonic() < end and any(group_exists(p.proc.pid) for p in procs):
        time.sleep(0.05)
    # Only now (no rank left) is it safe to remove the run's /dev/shm buffers; unreachable hosts are skipped.
    remove_shm([r for r in records if r["host"] not in set(res.unreachable)], ssh_args, transport=transport)
    msg = None
    if res.unreachable:
        msg = f"teardown could not reach host(s) {', '.join(sorted(set(res.unreachable)))}"
    elif res.left:
        msg = f"teardown left processes: {', '.join(res.left)}"
    events("teardown", msg, **res.as_dict())
