"""Issue 35 with the real ``ftkit launch``: a compiled op the plan needs is checked on the host before any rank
starts, and built there once. No rank is started in these tests (the checks refuse first), so each takes seconds.

* a toolchain that cannot build (no C++ compiler): exit 3, one line naming the host, the op, the cause and the fix;
* one that fails the build itself (a compiler that refuses): ``ftkit.launch.warmup`` builds once on the host before
  the ranks, its error is one line, its output in a log outside the run directory, exit 3;
* with ``zero.cpu_adam: auto`` the same host makes torch's AdamW step on the CPU instead: nothing to build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.doctor import clean_ftkit, failures, local_recipe

pytestmark = pytest.mark.slow


def _recipe(tmp_path: Path, cpu_adam: str) -> Path:
    from tests.helpers.runs import free_port

    p = local_recipe(tmp_path, master_port=free_port())
    p.write_text(p.read_text() + f"zero:\n  stage: 2\n  offload_optimizer: cpu\n  cpu_adam: {cpu_adam}\n")
    (tmp_path / "data.jsonl").write_text('{"text": "hello world"}\n')
    return p


def _no_rank_started(run: Path) -> None:
    assert not (run / "logs").exists() and not list(run.glob("ftkit/attempts/*/pids/*")), sorted(run.rglob("*"))


@pytest.mark.timeout(300)
def test_an_op_the_host_cannot_build_stops_the_launch_before_any_rank(tmp_path):
    recipe = _recipe(tmp_path, "true")
    env = {"CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    r = clean_ftkit("launch", str(recipe), env=env, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert failures(r) == [
        "host localhost: ops: cpu_adam (DeepSpeed's CPU Adam (optimizer offload), zero.cpu_adam true) cannot be "
        "built: no C++ compiler (c++, or $CXX): install g++"
    ]
    _no_rank_started(tmp_path / "run")


@pytest.mark.timeout(300)
def test_a_failing_build_runs_once_before_the_ranks_and_is_one_line(tmp_path):
    cxx = tmp_path / "c++"
    cxx.write_text("#!/bin/sh\necho 'fatal error: this compiler refuses' >&2\nexit 1\n")
    cxx.chmod(0o755)
    recipe = _recipe(tmp_path, "true")
    env = {"CXX": str(cxx), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    r = clean_ftkit("launch", str(recipe), env=env, timeout=200)
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = failures(r)
    assert line.startswith("host localhost: ops: building cpu_adam failed: CalledProcessError: "), line
    assert str(cxx) in line and line.endswith("[ftkit doctor checks the toolchain; zero.cpu_adam false needs no build]")
    log = Path(line.split("(log: ")[1].split(")")[0])
    assert log.is_file() and not log.is_relative_to(tmp_path / "run") and "FTKIT_WARMUP" in log.read_text()
    _no_rank_started(tmp_path / "run")

    # auto: the same host steps the offloaded optimizer with torch's AdamW, nothing is built (--dry-run's plan has
    # no facts: auto renders torch's AdamW; the launch's preflight finds this host cannot build CPU Adam)
    auto = _recipe(tmp_path / "auto", "auto")
    r = clean_ftkit("explain", str(auto), env=env)
    assert r.returncode == 0 and "optimizer.impl                      torch-cpu" in r.stdout, r.stdout


@pytest.mark.timeout(300)
def test_a_build_past_its_deadline_leaves_no_build_lock_behind(tmp_path):
    """The warm-up's deadline (resilience.startup_timeout_s) kills a build that runs too long; the killed build left
    torch's build lock, and every later launch on the host was refused by the preflight's stale-lock check (14 tests of
    one worker failed so). The launch removes it there and says so in its one line."""
    cxx = tmp_path / "c++"
    cxx.write_text("#!/bin/sh\nsleep 300\n")
    cxx.chmod(0o755)
    recipe = _recipe(tmp_path, "true")
    recipe.write_text(recipe.read_text() + "resilience:\n  startup_timeout_s: 25\n")
    ext = tmp_path / "ext"
    r = clean_ftkit("launch", str(recipe), env={"CXX": str(cxx), "TORCH_EXTENSIONS_DIR": str(ext)}, timeout=200)
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = failures(r)
    assert line.startswith("host localhost: ops: building cpu_adam did not finish: timed out"), line
    assert line.endswith(f"; removed the build lock its killed build left: {ext / 'cpu_adam' / 'lock'}"), line
    assert not (ext / "cpu_adam" / "lock").exists()
    _no_rank_started(tmp_path / "run")


@pytest.mark.timeout(400)
def test_the_warm_up_clears_a_build_lock_a_killed_build_left(tmp_path):
    """A build killed while it held torch's build baton leaves ``<op>/lock``; torch waits on it forever, so
    ``make install`` (and the launch's own warm-up) hung until CI's 90 minutes ran out. The warm-up removes a lock no
    process holds (ftkit.cluster.buildlocks' rule), says so in one line, and builds."""
    import os
    import subprocess
    import sys

    from tests.helpers.runs import copy_op_builds

    ext = copy_op_builds(tmp_path / "ext") or tmp_path / "ext"
    lock = ext / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu"}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ftkit.launch.warmup", "--ops", "deepspeed_shm_comm", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the warm-up still waits on the stale lock {lock} after 300 s")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-2000:]
    assert f"removed a stale build lock: {lock}" in text, text[-2000:]
    assert not lock.exists()
