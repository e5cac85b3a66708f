"""The real ``ftkit`` command line, in a subprocess, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_ftkit(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 60):
    """Run the real `ftkit` command line in a subprocess (as a user would)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ftkit", *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout
    )
