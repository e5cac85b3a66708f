"""Who owns a run directory: the owner record (``ftkit/owner.json``: host, pid, process start time, boot) and the
supervisor heartbeat's cadence, read by the supervisor (:mod:`ftkit.run.ownership` holds the ownership itself) and by
every rank's watchdog (:mod:`ftkit.launch.watchdog`). Standard library only."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from ftkit.cluster.hosts import is_local
from ftkit.cluster.procs import proc_start_time
from ftkit.errors import Problem, UserError
from ftkit.rundir.layout import RunDir

HEARTBEAT_S = 2.0  # how often the supervisor rewrites supervisor.json


def boot_id() -> str:
    """This boot's id: a pid and start time mean nothing across a reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def this_host() -> str:
    return socket.gethostname()


class OwnerRecord(TypedDict, total=False):
    """``RUN/ftkit/owner.json``: the job that owns the run directory."""

    host: str
    pid: int
    start_time: int | None
    boot_id: str
    time: float
    argv: list[str]


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    start_time: int | None
    boot_id: str = ""
    time: float = 0.0
    argv: tuple[str, ...] = ()

    @classmethod
    def me(cls) -> Owner:
        pid = os.getpid()
        return cls(this_host(), pid, proc_start_time(pid), boot_id(), round(time.time(), 3), tuple(sys.argv))

    @classmethod
    def from_json(cls, data: OwnerRecord) -> Owner:
        return cls(
            str(data["host"]),
            int(data["pid"]),
            None if (start := data.get("start_time")) is None else int(start),
            str(data.get("boot_id", "")),
            float(data.get("time", 0.0)),
            tuple(str(a) for a in data.get("argv", ())),
        )

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "argv": list(self.argv)}) + "\n"

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.time)) if self.time else "?"
        return f"pid {self.pid} on {self.host}, started {since}"

    @property
    def same_boot(self) -> bool:
        """Recorded by this running kernel: its pid can be checked here (containers of one machine included)."""
        return bool(self.boot_id) and self.boot_id == boot_id()

    @property
    def named_here(self) -> bool:
        return is_local(self.host) or self.host == this_host()


def read_owner(rd: RunDir) -> Owner | None:
    """The owner record, or None when there is none. A malformed record is a user-facing error."""
    path = rd.meta / "owner.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(Problem(f"cannot read the owner record: {e.strerror}", file=str(path))) from None
    try:
        return Owner.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(
            Problem("owner record is malformed; if no job runs here, delete it and launch again", file=str(path))
        ) from None
