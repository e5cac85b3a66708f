"""The import hook (``launch/inject/sitecustomize.py``, ``ftkit.launch.hook``) in a real interpreter, without ranks: it
chains to a site's own sitecustomize, does nothing outside a rank it owns, and stops a rank it cannot serve. Wrapped
scripts run for real: tests/integration/wrap/test_wrap.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ftkit.errors import ExitCode
from tests.helpers.paths import REPO


def _python_with_hook(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A real interpreter with ftkit's hook first on PYTHONPATH and a site's own sitecustomize after it."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("print('site-own sitecustomize ran')\n")
    e = {k: v for k, v in os.environ.items() if not k.startswith(("FTKIT_", "RANK", "LOCAL_RANK"))}
    e.update({"PYTHONPATH": f"{REPO / 'launch' / 'inject'}:{site}:{REPO}", **env})
    code = "import sys; print('inject' if 'ftkit.launch.hook' in sys.modules else 'plain', 'ftkit.hf' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=e)


def test_hook_chains_to_the_sites_own_sitecustomize_and_stays_out_of_the_way(tmp_path):
    plain = _python_with_hook(tmp_path, {})
    assert plain.returncode == 0 and plain.stdout.splitlines() == ["site-own sitecustomize ran", "plain False"]
    # the engine's own launcher process (no RANK): the hook is imported but does nothing
    launcher = _python_with_hook(tmp_path, {"FTKIT_RUN_DIR": str(tmp_path / "run")})
    assert launcher.returncode == 0 and launcher.stdout.splitlines()[-1] == "inject False", launcher.stdout
    # a process a rank started (another pid owns the hook): nothing either
    child = _python_with_hook(tmp_path, {"FTKIT_RUN_DIR": str(tmp_path / "run"), "RANK": "0", "FTKIT_HOOK_PID": "1"})
    assert child.returncode == 0 and child.stdout.splitlines()[-1] == "inject False", child.stdout


def test_hook_that_cannot_start_stops_the_rank(tmp_path):
    """A rank whose run directory has no spec: the hook cannot serve it, so it stops (exit 14) instead of letting
    the script train unwatched."""
    r = _python_with_hook(tmp_path, {"FTKIT_RUN_DIR": str(tmp_path / "nowhere"), "RANK": "0"})
    assert r.returncode == ExitCode.SCRIPT_FAILED, (r.stdout, r.stderr)
    assert "the import hook could not start" in (r.stdout + r.stderr)
