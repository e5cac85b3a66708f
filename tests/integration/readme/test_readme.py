"""Every command in the ``sh`` blocks of the README and of the docs pages it links runs as written, in order, in an
empty directory (the order and the pages: tests/helpers/readme.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.readme import readme_commands
from tests.helpers.runs import assert_no_process_left, mp_lock


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_commands_run_as_written(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with mp_lock():
        for cmd in readme_commands():
            out = subprocess.run(
                ["bash", "-c", cmd.replace("python ", f"{sys.executable} ", 1)],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            assert "Traceback" not in out.stderr, cmd
    assert (tmp_path / "myjob" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput" in (tmp_path / "myjob" / "report.html").read_text()
    assert (tmp_path / "myjob" / "runs" / "cpu-demo" / "final" / "ftkit_commit.json").exists()
    assert_no_process_left(tmp_path / "myjob" / "runs" / "cpu-demo")
