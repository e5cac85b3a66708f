"""Why an attempt failed, read from what it left: the ranks' error records and logs (issue 35).

A rank that fails with a cause a restart cannot change (a module not installed, a missing file, an op that cannot be
built, a configuration a library refuses: :mod:`ftkit.rundir.failures`) before its first step stops the launch at
once with its own exception line, where it ran and its log; any other failure is restarted, unless the start-up
failure repeats the previous attempt's cause. Ranks that only echo a peer's failure (connection reset, a collective
timed out) are never the cause while another rank has one.

:func:`attempt_cause` reads an attempt's rank logs (and, when no rank started, the engine's own), newest lines last,
without the records (the hook's records are read by the supervisor first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ftkit.rundir.failures import (
    COMM,
    EXIT,
    FailureClass,
    classify_exit,
    exception_line,
    log_frames,
    signature,
)
from ftkit.rundir.layout import RunDir

TAIL_BYTES = 64 << 10  # the end of each log holds the traceback that ended it


@dataclass(frozen=True)
class Cause:
    cls: FailureClass
    line: str | None = None  # the rank's own exception line (``OSError: CUDA_HOME environment variable is not set``)
    rank: int | None = None
    host: str | None = None
    log: str | None = None

    @property
    def signature(self) -> str | None:
        return signature(f"{self.cls.name}: {self.line}") if self.line else None

    def describe(self) -> str:
        """``rank 0 on node0: OSError: ... (log: RUN/logs/attempt-1/rank-0.log)``."""
        who = f"rank {self.rank}" if self.rank is not None else "the engine"
        where = f" on {self.host}" if self.host else ""
        log = f" (log: {self.log})" if self.log else ""
        return f"{who}{where}: {self.line or self.cls.name}{log}"


def _tail(path: Path) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def attempt_cause(rd: RunDir, attempt: int, exit_code: int | None, own_dirs: Iterable[str] = ()) -> Cause:
    """The attempt's cause from its logs: the first rank (by rank) whose log ends in an exception that is not a peer's
    echo, else an echo, else the engine log's own exception, else what the exit status says. ``own_dirs``: where
    else ftkit keeps its files (the local tier's root)."""
    hosts = {r.get("rank"): r.get("host") for r in rd.records("pids", attempt)}
    own = [str(rd.path), *own_dirs]
    found: list[Cause] = []
    logs = sorted(rd.log_dir(attempt).glob("rank-*.log"), key=lambda p: int(p.stem.split("-")[1]))
    for log in [*logs, *sorted(rd.log_dir(attempt).glob("launcher-node*.log"))]:
        lines = _tail(log)
        line = exception_line(lines)
        if line is None:
            continue
        rank = int(log.stem.split("-")[1]) if log.stem.startswith("rank-") else None
        host = hosts.get(rank) if rank is not None else None
        found.append(Cause(classify_exit(None, line, log_frames(lines), own=own), line, rank, host, str(log)))
        if rank is None and found[0].rank is not None:
            break  # a rank's own cause outranks what its launcher printed about it
    theirs = [c for c in found if c.cls is not COMM]  # not a peer's echo
    if theirs:
        fixed = [c for c in theirs if not c.cls.restartable]
        return fixed[0] if fixed else theirs[0]
    by_exit = classify_exit(exit_code, None)
    if by_exit is not EXIT:
        return Cause(by_exit)  # killed: the echoes in the other logs are its consequence
    return found[0] if found else Cause(by_exit)
