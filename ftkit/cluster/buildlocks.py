"""Stale JIT build locks: torch's extension builder waits forever on a ``lock`` file a killed build left behind.

torch.utils.cpp_extension (used by DeepSpeed for its CPU Adam and shared-memory ops) guards each build with a
``FileBaton``: ``<build dir>/lock`` created with O_CREAT|O_EXCL, its descriptor kept open by the building process
for the whole build, removed when the build ends. A process that waits for the baton only polls for the file to
disappear. A build killed at the wrong moment (SIGKILL, OOM, a teardown) leaves the file, and every later rank
that needs the op then waits on it silently, forever.

Build directories: ``$TORCH_EXTENSIONS_DIR/<op>/`` when that is set, else
``${XDG_CACHE_HOME:-~/.cache}/torch_extensions/py<XY>_<cpu|cuNNN|rocmNNN>/<op>/``.

**Rule** (stated once, used by ``ftkit doctor`` and the supervisor's loading hint): a ``lock`` is *stale* when no
process on this machine holds its build — none has the lock file open (the baton holder keeps its descriptor) and
none runs in the op's directory (ninja and the compiler run with that cwd) — in two looks ``CONFIRM_S`` apart, the
same file both times (other jobs' ranks take and give back batons many times a second while they load). Processes
whose /proc entries cannot be read (another user's, without root) are not seen; on a file system shared between
hosts a build running on another host is not seen either, so ``ftkit doctor`` runs the check on every host and calls
a lock stale only when no host holds it.
The fix is ``rm <lock>``: the next rank rebuilds (or reuses) the op.

Import-light: standard library only.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

LOADING_HINT_AFTER_S = 60.0  # a rank still "loading" this long while a stale lock exists gets a hint
CONFIRM_S = 0.5  # an unheld lock is looked at again after this long before it is called stale


def extension_roots(env: Mapping[str, str] | None = None) -> list[Path]:
    """Directories whose children are op build directories (the torch_extensions layout above)."""
    env = os.environ if env is None else env
    explicit = env.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return [Path(explicit)]
    home = env.get("HOME") or os.path.expanduser("~")
    cache = Path(env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")) / "torch_extensions"
    try:
        return sorted(p for p in cache.iterdir() if p.is_dir())
    except OSError:
        return []


def build_locks(env: Mapping[str, str] | None = None) -> list[Path]:
    """Every ``<op>/lock`` file under the extension roots, held or not."""
    out: list[Path] = []
    for root in extension_roots(env):
        try:
            out += sorted(p for p in root.glob("*/lock") if p.is_file())
        except OSError:
            continue
    return out


def _holders(locks: Iterable[Path], proc: Path = Path("/proc")) -> dict[Path, int]:
    """lock -> the pid of one process on this machine that holds its build (open lock file or cwd in its dir)."""
    wanted = {str(p.resolve()): p for p in locks}
    dirs = {str(Path(k).parent): v for k, v in wanted.items()}
    held: dict[Path, int] = {}
    if not wanted:
        return held
    try:
        pids = [int(d.name) for d in proc.iterdir() if d.name.isdigit()]
    except OSError:
        return held
    me = os.getpid()
    for pid in pids:
        if pid == me:
            continue
        base = proc / str(pid)
        try:
            cwd = os.readlink(base / "cwd")
        except OSError:
            cwd = ""
        if cwd in dirs:
            held.setdefault(dirs[cwd], pid)
        try:
            fds = os.listdir(base / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(base / "fd" / fd)
            except OSError:
                continue
            if target in wanted:
                held.setdefault(wanted[target], pid)
    return held


def _identity(lock: Path) -> tuple[int, int] | None:
    """The lock file's inode and modification time; None once it is gone."""
    try:
        st = lock.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def lock_states(env: Mapping[str, str] | None = None, *, confirm_s: float = CONFIRM_S) -> list[tuple[Path, int | None]]:
    """(lock, pid holding its build or None) for every build lock on this machine.

    A lock is reported unheld only when it was unheld in two scans ``confirm_s`` apart and is the same file in
    both. Another job's ranks take and give back the baton of every op they load (the file created, a no-op
    build, the descriptor closed, the file removed): a scan that lists the lock, then reads /proc after its
    holder let go, must not call it stale. A lock removed meanwhile is left out.
    """
    locks = build_locks(env)
    held = _holders(locks)
    unheld = {p: _identity(p) for p in locks if p not in held}
    unheld = {p: ident for p, ident in unheld.items() if ident is not None}
    if unheld and confirm_s > 0:
        time.sleep(confirm_s)
        again = _holders(list(unheld))
        for p, ident in list(unheld.items()):
            if p in again:
                held[p] = again[p]
            if p in again or _identity(p) != ident:
                del unheld[p]
    return [(p, held.get(p)) for p in locks if p in held or p in unheld]


def stale_build_locks(env: Mapping[str, str] | None = None) -> list[Path]:
    """The build locks no process on this machine holds (see the module's rule); ``rm`` each to unblock ranks."""
    return [p for p, pid in lock_states(env) if pid is None]


def clear_stale_locks(ops: Iterable[str], env: Mapping[str, str] | None = None) -> list[Path]:
    """Remove the stale build locks (the module's rule) of the ops named; returns the locks removed. For the
    warm-up, which is about to build those ops: torch would wait on such a lock forever."""
    wanted = set(ops)
    removed: list[Path] = []
    for lock in stale_build_locks(env):
        if lock.parent.name not in wanted:
            continue
        try:
            lock.unlink()
        except FileNotFoundError:  # its builder let go meanwhile
            continue
        removed.append(lock)
    return removed


def loading_hint(
    heartbeats: Iterable[Mapping[str, object]],
    now: float,
    *,
    since: Mapping[int, tuple[str, float]] | None = None,
    after_s: float = LOADING_HINT_AFTER_S,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """For the supervisor: one line when a rank has been loading for ``after_s`` or more while a stale build lock
    exists on this machine, else None.

    "Loading" is every phase before the first step: ``starting`` (a wrapped script), ``loading`` (the built-in
    entry; DeepSpeed's shm op builds in init_distributed) and ``train`` with no step yet (DeepSpeed builds CPU Adam
    inside ``trainer.train()``, after that heartbeat).

    ``since`` is the supervisor's own record of when each rank entered its phase (``Progress.phases``: rank ->
    (phase, time on the caller's clock, the clock of ``now``)); without it the heartbeat's own ``time`` is used
    (the rank's clock). The lock scan runs only once some rank qualifies, so calling this every poll is cheap.
    """
    waiting: list[int] = []
    for hb in heartbeats:
        phase = hb.get("phase")
        if not (phase in ("starting", "loading") or (phase == "train" and hb.get("step") is None)):
            continue
        rank = hb.get("rank")
        entered = None
        if since is not None and isinstance(rank, int) and rank in since and since[rank][0] == phase:
            entered = since[rank][1]
        elif since is None and isinstance(t := hb.get("time"), (int, float)):
            entered = float(t)
        if entered is not None and now - entered >= after_s:
            waiting.append(rank if isinstance(rank, int) else -1)
    if not waiting:
        return None
    stale = stale_build_locks(env)
    if not stale:
        return None
    ranks = ", ".join(str(r) for r in sorted(waiting))
    rms = " && ".join(f"rm {p}" for p in stale)
    return (
        f"rank(s) {ranks} still loading after {after_s:g}s while a stale torch extension build lock exists: "
        f"{', '.join(map(str, stale))} (a killed build left it; ranks wait on it forever) [{rms}]"
    )


if __name__ == "__main__":  # python -m ftkit.cluster.buildlocks [--clear OP,OP]: list (or remove) stale locks
    if len(sys.argv) == 3 and sys.argv[1] == "--clear":
        for p in clear_stale_locks(sys.argv[2].split(",")):
            print(f"removed {p}")
        sys.exit(0)
    found = stale_build_locks()
    for p in found:
        print(p)
    sys.exit(1 if found else 0)
