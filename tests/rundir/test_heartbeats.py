"""The supervisor's heartbeat poll at scale: 1,024 rank heartbeat files, read once per poll, cheaply when nothing
changed and every change still seen (issue 13)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ftkit.rundir.layout import RunDir, atomic_write


def _beat(rd: RunDir, rank: int, step: int) -> None:
    rec = {"rank": rank, "attempt": 0, "phase": "train", "step": step, "time": time.time(), "node": f"node{rank // 8}"}
    atomic_write(rd.heartbeat(rank), json.dumps(rec), fsync=False)  # as ranks write it


def test_heartbeat_poll_of_1024_ranks_is_cheap(tmp_path: Path) -> None:
    """The supervisor reads every heartbeat once per poll (every 0.5 s). Reading and parsing 1,024 files took
    ~30-55 ms per poll even when nothing had changed; unchanged files are now only stat'ed (target < 50 ms per
    poll in any case; bounded loosely here, the machine is shared). Changes are still all seen."""
    writer, rd = RunDir(tmp_path), RunDir(tmp_path)
    for rank in range(1024):
        _beat(writer, rank, 7)
    assert [h["rank"] for h in rd.heartbeats()] == sorted(range(1024), key=lambda r: f"rank-{r}.json")
    # An unchanged heartbeat is only stat'ed, never opened: counted with an audit hook (deterministic, unlike a
    # stopwatch on a shared machine: a 20 ms bound failed under load), plus a loose bound on the time.
    opened: list[str] = []
    watching = [False]

    def hook(event: str, args: tuple[object, ...]) -> None:
        if watching[0] and event == "open" and str(args[0]).startswith(str(rd.meta)):
            opened.append(str(args[0]))

    sys.addaudithook(hook)  # cannot be removed: it only records while `watching`
    times = []
    for _ in range(5):
        watching[0] = True
        t0 = time.perf_counter()
        hbs = rd.heartbeats()
        times.append(time.perf_counter() - t0)
        watching[0] = False
    assert len(hbs) == 1024 and {h["step"] for h in hbs} == {7}
    assert opened == [], opened[:3]
    assert min(times) < 1.0, times  # ~5 ms idle; generous for a loaded machine
    # every kind of change shows at the next poll
    _beat(writer, 5, 8)
    writer.heartbeat(6).unlink()
    writer.heartbeat(7).write_text("{torn")
    hbs[0]["step"] = "changed by a caller"
    polled = {h["rank"]: h["step"] for h in rd.heartbeats()}
    assert polled[5] == 8 and 6 not in polled and 7 not in polled and polled[0] == 7
    _beat(writer, 7, 9)
    assert {h["rank"]: h["step"] for h in rd.heartbeats()}[7] == 9
    assert RunDir(tmp_path / "none").heartbeats() == []
