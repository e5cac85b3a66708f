"""Continuing on fewer hosts: find the lost ones, and convert a checkpoint to DeepSpeed's universal format.

After a teardown the supervisor probes every remote host of the attempt (:func:`probe_hosts`). When some are lost
and ``cluster.min_nodes`` allows it (:func:`ftkit.supervise.decide.decide` says SHRINK), the job is replanned on the
rest keeping the global batch, and the newest committed checkpoint, saved by more ranks, is converted with DeepSpeed's
``ds_to_universal`` (:func:`convert_newest`) and loaded with ``checkpoint.load_universal`` for one attempt.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit.checkpoint.directory import Selection, set_aside_newer
from ftkit.checkpoint.verify import Verdict
from ftkit.cluster.fanout import run_on_hosts
from ftkit.cluster.hosts import LOCAL_HOSTS
from ftkit.errors import ExitCode
from ftkit.rundir.records import CommitRecord, EventSink
from ftkit.supervise.universal import ConversionError, convert_to_universal

if TYPE_CHECKING:
    from ftkit.cluster.fanout import Transport


def probe_hosts(
    hosts: list[tuple[str, int]], ssh_args: list[str], timeout: float = 10, transport: Transport | None = None
) -> list[str]:
    """Remote hosts that ssh (or ``transport``: srun inside a Slurm allocation) cannot reach now (``true``), all
    probed at once: one ``timeout`` in total."""
    remote = [host for host, _ in hosts if host not in LOCAL_HOSTS]
    res = run_on_hosts(remote, "true", ssh_args, deadline_s=timeout + 2, connect_timeout_s=timeout, transport=transport)
    return [host for host, r in res.items() if not r.reachable]


def convert_newest(sel: Selection, incompatible: list[Verdict], world_size: int, events: EventSink) -> str | int | None:
    """Convert the newest intact checkpoint saved with another world size (newer than any compatible one) to the
    universal format. Returns its path, an exit code (refused), or None when a compatible checkpoint is newer."""

    v = max(incompatible, key=lambda x: x.step or -1)
    if sel.step is not None and (v.step or -1) <= sel.step:
        return None
    assert v.path is not None
    if v.kind != "world_size_mismatch":
        events(
            "refused",
            f"{v.reason}: a different ZeRO stage cannot be resumed; launch with the original zero.stage",
            checkpoint=str(v.path),
        )
        return ExitCode.NO_CHECKPOINT
    record: CommitRecord = v.record or {}
    tag = record.get("tag") or (v.path / "latest").read_text().strip()
    t0 = time.monotonic()
    try:
        convert_to_universal(v.path, tag)
    except ConversionError as e:
        events("refused", f"{e}; cannot resume on {world_size} rank(s)", checkpoint=str(v.path))
        return ExitCode.NO_CHECKPOINT
    events(
        "converted",
        f"converted {v.path.name} ({record.get('world_size')} ranks) to DeepSpeed's universal checkpoint for "
        f"{world_size} rank(s) in {time.monotonic() - t0:.1f}s",
        checkpoint=str(v.path),
        from_world_size=record.get("world_size"),
        to_world_size=world_size,
    )
    # Newer torn checkpoints are moved aside as usual; older compatible ones stay.
    for dst in set_aside_newer(v.path.parent, Selection(chosen=v.path, step=v.step, verdict=v, rejected=[])):
        events("set_aside", f"moved {dst.name.split('.rejected')[0]} aside to {dst.name}", dst=str(dst))
    events(
        "checkpoint_chosen",
        f"resuming from {v.path.name} (step {v.step}, commit verified, universal format)",
        checkpoint=str(v.path),
        step=v.step,
        universal=True,
    )
    return str(Path(v.path))
