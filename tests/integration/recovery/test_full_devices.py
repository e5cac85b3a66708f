"""Issue 36, item 12: a full local tier, and a /dev/shm too small for DeepSpeed's CPU collectives, end with one line
naming the place instead of three attempts and exit 4.

Each test runs ``ftkit launch`` in a mount namespace of its own (``unshare -m``, root) where a small tmpfs stands in
for the full device: the machine's own /dev/shm and file systems are untouched.

* /dev/shm of 64 MiB under 2 CPU ranks (DeepSpeed maps 66 MiB per rank there): every rank used to die of SIGSEGV
  at its first collective, 3 attempts, exit 4, the preflight only warning; now the preflight refuses, exit 3, no
  rank started;
* a local checkpoint tier on a 2 MiB tmpfs: the first local save fails inside torch.save ("unexpected pos"), used
  to be restarted 3 times to exit 4; now exit 12 naming the tier directory, after one attempt.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.errors import ExitCode
from tests.helpers.runs import RUN_ENV, assert_no_process_left, mp_lock, named, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _in_namespace(mount: str, size: str, recipe: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``ftkit launch RECIPE`` in a private mount namespace where ``mount`` is a fresh tmpfs of ``size``."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed for this test")
    ftkit = shlex.join([sys.executable, "-m", "ftkit", "launch", str(recipe)])
    line = f"mkdir -p {shlex.quote(mount)} && mount -t tmpfs -o size={size} tmpfs {shlex.quote(mount)} && {ftkit}"
    env = {**__import__("os").environ, **RUN_ENV}
    with mp_lock():
        return subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", line],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )


def test_a_dev_shm_too_small_for_deepspeed_s_cpu_collectives_is_refused_before_any_rank(fx, tmp_path):
    recipe = write_recipe(tmp_path, fx)
    r = _in_namespace("/dev/shm", "64m", recipe)
    assert r.returncode == ExitCode.PREFLIGHT, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ftkit: error: ")]
    assert errors == [
        "ftkit: error: host localhost: shm: /dev/shm has 0.1G free: DeepSpeed's CPU collectives need 66 MiB per "
        "rank (2 here: 0.1G); every rank would die of SIGBUS at its first collective [enlarge it (docker run "
        "--shm-size=16g; mount -o remount,size=16G /dev/shm) or remove stale buffers]"
    ], r.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_a_full_local_tier_ends_with_exit_12_naming_it(fx, tmp_path):
    tier = tmp_path / "tier"
    recipe = write_recipe(tmp_path, fx, checkpoint__local_dir=str(tier / "{host}"), checkpoint__local_steps=2)
    r = _in_namespace(str(tier), "2m", recipe)
    run = tmp_path / "run"
    assert r.returncode == ExitCode.NO_SPACE, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(named(run, "launch")) == 1 and not named(run, "restart"), named(run, "failure")
    (failure,) = named(run, "failure")
    assert failure["kind"] == "no_space", failure
    out = r.stdout + r.stderr
    assert f"no space left on {tier}/" in out, out[-3000:]
    tier.rmdir()  # the mount point this test made (the tmpfs went with its namespace)
    assert_no_process_left(run)
