"""The build locks a run's ranks hold: recorded while held, so the ones a killed rank left can be removed safely.

torch guards each JIT build of an op (DeepSpeed's CPU Adam, its shared-memory op) with a ``FileBaton``: a ``lock``
file created with O_CREAT|O_EXCL and removed in a ``finally``. Every rank takes it for every op it loads, even with
nothing to build. A rank killed while it holds one (a teardown's SIGKILL, the OOM killer, a lost node) leaves the
file, and every later rank that loads the op waits on it forever (:mod:`ftkit.cluster.buildlocks` finds such locks
and names them).

So each rank records the batons it takes in ``RUN/ftkit/batons/`` (:func:`record`, removed again by :func:`forget`
when it gives the baton back). Before anything loads an op, the launch's preflight (on every host) and each rank's
start-up call :func:`release_dead`, which removes a lock only when all of these hold:

* a process of this run recorded creating it (ftkit wrote it; a lock nobody recorded is never touched);
* that process is gone: the record was made on this machine (same kernel boot and pid namespace, so its pid can be
  looked up here) and no process with that pid and start time exists;
* the file is still the one it created (same device, inode and modification time).

Concurrent callers (the ranks of one host start together) claim a record by renaming it; only one wins.

Import-light: standard library only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ftkit.cluster.procs import proc_start_time
from ftkit.rundir.layout import atomic_write
from ftkit.rundir.owner import boot_id

RECORD_SUFFIX = ".json"


def machine() -> str:
    """This kernel boot and pid namespace: where a recorded pid means the same process ("" when unknown)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    boot = boot_id()
    return f"{boot} {ns}" if boot else ""


def record(records: Path, lock: str | os.PathLike[str]) -> Path | None:
    """Record that this process has just created ``lock``; the record's path, or None where none could be made."""
    pid = os.getpid()
    here = machine()
    try:
        st = os.stat(lock)
        if not here:
            return None
        path = records / f"{pid}-{st.st_ino}{RECORD_SUFFIX}"
        data = {
            "lock": os.path.abspath(lock),
            "dev": st.st_dev,
            "ino": st.st_ino,
            "mtime_ns": st.st_mtime_ns,
            "pid": pid,
            "start": proc_start_time(pid),
            "machine": here,
        }
        atomic_write(path, json.dumps(data), fsync=False)  # gone with the baton: not worth a disk flush
    except OSError:
        return None
    return path


def forget(path: Path | None) -> None:
    """The baton was given back: drop its record."""
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def release_dead(records: Path) -> list[str]:
    """Remove every build lock a dead process of this run left on this machine (the rules above); their paths."""
    try:
        names = sorted(p for p in records.iterdir() if p.name.endswith(RECORD_SUFFIX))
    except OSError:
        return []
    here = machine()
    removed: list[str] = []
    for path in names:
        try:
            data = json.loads(path.read_text())
            lock, pid = str(data["lock"]), int(data["pid"])
            mine = here and data.get("machine") == here
        except (OSError, ValueError, KeyError, TypeError):
            continue  # gone meanwhile (another caller claimed it), or not a record of ours: left alone
        if not mine or proc_start_time(pid) == data.get("start"):
            continue  # another machine's process, or one still alive
        claimed = path.with_name(f"{path.name}.claimed{os.getpid()}")
        try:
            os.rename(path, claimed)
        except OSError:
            continue  # another caller claimed it first
        try:
            st = os.stat(lock)
            if (st.st_dev, st.st_ino, st.st_mtime_ns) == (data.get("dev"), data.get("ino"), data.get("mtime_ns")):
                os.unlink(lock)
                removed.append(lock)
        except OSError:
            pass  # gone already, or not ours to remove
        forget(claimed)
    return removed
