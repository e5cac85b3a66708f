"""The build locks a run's ranks hold (ftkit.rundir.batons): a rank records each torch build baton it takes, and the
next rank's start-up (or the launch's preflight, tests/run/test_doctor.py) removes the ones a killed rank left, and
no other lock. Real processes holding torch's own FileBaton, killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.rundir import batons
from tests.helpers.doctor import holding_rank, read_until


def _killed(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.heavy
def test_a_lock_a_killed_rank_left_is_removed_by_the_next_ranks_start_up(tmp_path: Path) -> None:
    records, lock = tmp_path / "run" / "ftkit" / "batons", tmp_path / "ext" / "cpu_adam" / "lock"
    first = holding_rank(records, lock)
    try:
        assert read_until(first, "held")[-1] == "held"
        (rec,) = records.iterdir()
        assert json.loads(rec.read_text())["lock"] == str(lock)
    finally:
        _killed(first)
    assert lock.exists()  # torch removes it only in a `finally` the SIGKILL never ran

    second = holding_rank(records, lock)
    try:
        lines = read_until(second, "held")
    finally:
        _killed(second)
    assert f"ftkit: removed {lock}: a build lock a killed rank of this run left on this host" in lines, lines
    assert lines[-1] == "held"  # the op loads: without the removal torch would wait on the file forever


@pytest.mark.heavy  # torch's own FileBaton, in a process of its own
def test_a_baton_given_back_leaves_no_record(tmp_path: Path) -> None:
    records, lock = tmp_path / "batons", tmp_path / "ext" / "op" / "lock"
    proc = holding_rank(records, lock, give_back=True)
    try:
        assert read_until(proc, "given back")[-2:] == ["held", "given back"]
        assert not lock.exists() and list(records.iterdir()) == []
    finally:
        _killed(proc)


def _take(records: Path, lock: Path) -> subprocess.Popen:
    """A process that creates ``lock`` as torch does (O_EXCL), records it, says ready and sleeps."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    code = (
        "import os, time\n"
        "from pathlib import Path\n"
        "from ftkit.rundir import batons\n"
        f"os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)\n"
        f"batons.record(Path({str(records)!r}), {str(lock)!r})\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_only_locks_this_runs_dead_processes_created_are_removed(tmp_path: Path) -> None:
    records, ext = tmp_path / "batons", tmp_path / "ext"
    dead, alive = ext / "dead" / "lock", ext / "alive" / "lock"
    recreated, elsewhere = ext / "recreated" / "lock", ext / "elsewhere" / "lock"
    foreign = ext / "foreign" / "lock"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("")  # a lock nobody of this run recorded: never ftkit's to remove
    holder = _take(records, alive)
    procs = [_take(records, p) for p in (dead, recreated, elsewhere)]
    for p in procs:
        _killed(p)
    recreated.unlink()
    recreated.write_text("")  # someone else's lock at the same path since: not the file the dead process made
    (far,) = [r for r in records.iterdir() if json.loads(r.read_text())["lock"] == str(elsewhere)]
    data = json.loads(far.read_text())
    far.write_text(json.dumps({**data, "machine": "another-boot pid:[1]"}))  # its pid means nothing here
    try:
        assert batons.release_dead(records) == [str(dead)]
        assert not dead.exists() and all(p.exists() for p in (alive, recreated, elsewhere, foreign))
        left = sorted(json.loads(r.read_text())["lock"] for r in records.iterdir())
        assert left == sorted([str(alive), str(elsewhere)])  # the live holder's and the other machine's
        assert batons.release_dead(records) == []
    finally:
        _killed(holder)
    assert batons.release_dead(records) == [str(alive)]  # once its holder is gone too
    assert os.path.exists(elsewhere)
