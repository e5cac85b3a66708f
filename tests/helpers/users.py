"""A second, unprivileged local user: what another user of a shared node can do to a run (issue 36).

``other_user()`` adds one with ``useradd`` for the test and removes it after (we are root here and in CI); commands
run as it through ``setpriv`` (no login, no PAM, no home directory).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class LocalUser:
    name: str
    uid: int
    gid: int

    def run(self, *argv: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """``argv`` as this user (its own uid, gid and no supplementary group)."""
        cmd = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=check, cwd="/")


@contextmanager
def other_user() -> Iterator[LocalUser]:
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        pytest.skip("needs root, useradd and setpriv (a second local user)")
    name = f"ftkit-other-{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        pw = pwd.getpwnam(name)
        yield LocalUser(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)
