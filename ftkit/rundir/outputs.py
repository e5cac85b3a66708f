"""Where a command may write what the user asked for (``ftkit report -o``, ``ftkit status --plot``, ``ftkit export
-o``): the rules every such path obeys, in one place.

* **Never inside a run's own state**, whatever ``--force`` says: the run directory itself, its ``ftkit/``, ``logs/``,
  ``events.jsonl``, ``metrics.jsonl``, ``final/``, ``checkpoint-N*`` and staging directories. What a run directory
  may receive besides: ``report.html`` (``ftkit report``'s default), ``exports/`` (``ftkit export``'s default) and
  any other name of the user's own.
* **Never over what this command did not write** without ``--force``: the caller says how it recognises its own
  output (a report page, a plot, an export).
* **A file goes into a directory that exists**: a mistyped ``-o /nonexistent/x.html`` is refused, not created.

Symbolic links are resolved first, as the write itself would follow them: a link to ``RUN/events.jsonl`` is that file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from ftkit.errors import Problem, UserError
from ftkit.rundir.layout import RunDir

STATE_NAMES = frozenset({"ftkit", "logs", "events.jsonl", "metrics.jsonl", "final"})
_STATE_RE = re.compile(r"^(checkpoint-\d+.*|\.staging-.*)$")  # checkpoints (set aside too), durable copies arriving


def run_root(path: Path) -> Path | None:
    """The run directory ``path`` is or lies in (a directory holding ``ftkit/spec.json``, or ``ftkit/`` and
    ``events.jsonl``), None when it is in none."""
    for d in (path, *path.parents):
        rd = RunDir(d)
        try:
            if rd.spec.is_file() or (rd.meta.is_dir() and rd.events.is_file()):
                return d
        except OSError:
            continue
    return None


def run_state(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is part of a run directory's own state (one phrase), None when it is not."""
    p = Path(os.path.realpath(path))
    root = run_root(p)
    if root is None:
        return None
    if p == root:
        return f"is the run directory {root} itself"
    first = p.relative_to(root).parts[0]
    if first in STATE_NAMES or _STATE_RE.match(first):
        return f"is inside {root / first}, the run's own state"
    return None


def check_output_file(
    path: str | os.PathLike[str], *, ours: Callable[[Path], bool], force: bool, what: str, key: str
) -> Path:
    """Refuse (exit 2, one line) an output file that would land in a run's own state, in a directory that does
    not exist, on a directory, or over a file that ``ours`` does not recognise as this command's (unless
    ``force``). Returns the path to write."""
    target = Path(path)
    where = str(path)
    why = run_state(target)
    if why is not None:
        raise UserError(Problem(f"{why}: ftkit never writes a {what} there; pick another path", file=where, key=key))
    parent = Path(os.path.realpath(target)).parent
    if not parent.is_dir():
        raise UserError(
            Problem(f"{parent} does not exist (or is not a directory): create it first", file=where, key=key)
        )
    if target.is_dir():
        raise UserError(Problem("is a directory; give a file path", file=where, key=key))
    if target.exists() and not force and not ours(target):
        raise UserError(Problem(f"exists and is not a {what} ftkit wrote (--force replaces it)", file=where, key=key))
    return target


def starts_with(path: Path, *needles: bytes, within: int = 8192) -> bool:
    """Every one of ``needles`` is in the first ``within`` bytes of ``path`` (False when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(within)
    except OSError:
        return False
    return all(n in head for n in needles)
