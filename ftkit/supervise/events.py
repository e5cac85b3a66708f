"""``events.jsonl`` as the supervisor writes it: one line per decision, its message said to the user too."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable

from ftkit.rundir.layout import RunDir, append_jsonl


def is_no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


class Events:
    """Append decisions to events.jsonl and echo their message. A write that fails (a full disk) is remembered in
    ``write_error`` and the message still reaches the terminal."""

    def __init__(self, rd: RunDir, echo: Callable[[str], None]):
        self.rd = rd
        self.echo = echo
        self.attempt = 0
        self.write_error: OSError | None = None

    def __call__(self, event: str, message: str | None = None, /, **data: object) -> None:
        rec: dict[str, object] = {"time": round(time.time(), 3), "event": event, "attempt": self.attempt, **data}
        if message:
            rec["message"] = message
        try:
            append_jsonl(self.rd.events, rec)
        except OSError as e:
            self.write_error = self.write_error or e
        if message:
            self.echo(f"ftkit: {message}")
