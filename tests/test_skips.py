"""A skip that hides a broken install or a missing harness fails the suite (issue 41 point 6; tests/conftest.py): a
real pytest run of one real test, with ``deepspeed`` made unimportable the way a broken install is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import required_skip
from tests.helpers.paths import REPO

GUARDED = "tests/rundir/test_failures.py::test_a_library_s_configuration_error_is_classed_by_where_it_was_raised"


@pytest.mark.parametrize(
    ("reason", "name"),
    [
        ("could not import 'deepspeed': No module named 'deepspeed'", "deepspeed"),
        ("could not import 'torch.distributed': No module named 'torch'", "torch"),
        ("deepspeed is not installed", "deepspeed"),
        ("multinode harness unavailable: needs root", "multinode"),
        ("real Slurm tests need root (network namespaces, slurmd)", "slurm"),
        ("needs Debian's chromium (apt-get install chromium, as root)", "chromium"),
        ("cannot mount a tmpfs here (permission denied)", None),
        ("no pyenv shims here: nothing to hold", None),
        ("no /dev/full", None),
        ("no common free port on the loopback addresses", None),
    ],
)
def test_which_skips_are_required(reason, name):
    assert required_skip(reason) == name


def _pytest(tmp_path: Path, allow: str | None) -> subprocess.CompletedProcess:
    broken = tmp_path / "broken"
    (broken / "deepspeed").mkdir(parents=True, exist_ok=True)
    (broken / "deepspeed" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'deepspeed'\")\n")
    env = {k: v for k, v in os.environ.items() if k not in ("FTKIT_TEST_ALLOW_SKIPS", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = os.pathsep.join([str(broken), str(REPO), env.get("PYTHONPATH", "")])
    env["FTKIT_SKIP_COUNT_FILE"] = str(tmp_path / "skips")
    if allow is not None:
        env["FTKIT_TEST_ALLOW_SKIPS"] = allow
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", GUARDED]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_required_dependency_that_cannot_be_imported_fails_unless_allowed(tmp_path):
    r = _pytest(tmp_path, None)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "1 failed" in r.stdout and "required, not skipped: could not import 'deepspeed'" in r.stdout, r.stdout
    assert "FTKIT_TEST_ALLOW_SKIPS=deepspeed" in r.stdout
    assert (tmp_path / "skips").read_text() == "0\n"
    # a developer's partial machine: named, it skips (counted, the reason shown once)
    r = _pytest(tmp_path, "multinode,deepspeed")
    assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout[-3000:]
    assert "skipped: 1" in r.stdout and "[allowed by FTKIT_TEST_ALLOW_SKIPS]" in r.stdout, r.stdout
    assert (tmp_path / "skips").read_text() == "1\n"
