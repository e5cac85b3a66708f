"""Fixtures of the real multi-process runs: the fixtures model and one uninterrupted reference run (made once per
session), and two namespace hosts. The Slurm cluster is in slurm/conftest.py."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ftkit.rundir.env import path_with_python_first
from tests.helpers.netns import NetnsCluster, netns_cluster, require_netns

# Every process these tests start finds the tools beside this Python first, as ftkit's ranks do (run_env) and as an
# activated virtual environment would: the system's ninja and the venv's hash DeepSpeed's op builds differently, so
# a test that starts DeepSpeed or Accelerate itself with the system's would recompile the ops the ranks built (and
# the next rank would recompile them back: 30-90 s each, seen 8 times in one run before this).
os.environ["PATH"] = path_with_python_first(sys.executable, os.environ.get("PATH"))

# Real 2-rank runs (tests marked slow): the fixtures model and one uninterrupted reference run, made once per session
# (tests read them and copy what they change: each costs a model build or a 2-rank launch).


def _once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], dict]) -> dict:
    """``build(directory)`` once for the whole test run: under pytest-xdist the workers share one result (the first
    builds it under a file lock, the others read it), so a parallel tier pays for each shared run once."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(factory.mktemp(name))
    from filelock import FileLock

    root = factory.getbasetemp().parent  # the run's directory, above every worker's own
    done = root / f"{name}.pickle"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            # a directory of its own for each try: a build that failed in another worker left its half-done run in
            # its own, and this one starts clean instead of failing on what that one left
            d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
            done.write_bytes(pickle.dumps(build(d)))
    return pickle.loads(done.read_bytes())  # noqa: S301 (written by this test run, above)


@pytest.fixture(scope="session", autouse=True)
def _own_op_builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, each worker's runs load DeepSpeed's JIT ops from the worker's own copy of this machine's
    builds (``TORCH_EXTENSIONS_DIR``). A rank killed while it holds an op's build baton leaves a lock that every
    later rank using that directory waits on; with a copy per worker, a test's kills reach only its own worker's
    later runs, as in a one-at-a-time suite."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("TORCH_EXTENSIONS_DIR"):
        yield
        return
    from tests.helpers.runs import copy_op_builds

    own = copy_op_builds(tmp_path_factory.mktemp("torch_extensions") / "builds")
    if own is None:  # nothing built yet (make install builds them): the ranks build their own
        yield
        return
    os.environ["TORCH_EXTENSIONS_DIR"] = str(own)
    try:
        yield
    finally:
        del os.environ["TORCH_EXTENSIONS_DIR"]


@pytest.fixture(scope="session")
def fx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model, tokenizer and learnable data, made once per session (read-only for tests)."""
    from tests.helpers.runs import make_fixtures

    return _once(tmp_path_factory, "fixtures", make_fixtures)


@pytest.fixture(scope="session")
def baseline(fx: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted run: its losses are what every recovered run must reproduce; its run directory is
    copied by the corruption tests (checkpoint-8 and checkpoint-12 committed)."""
    return _once(tmp_path_factory, "baseline", lambda d: _baseline(fx, d))


def _baseline(fx: dict[str, Path], d: Path) -> dict:
    from tests.helpers.runs import RUN_ENV, RUN_STEPS, RUN_TIMEOUT_S, assert_no_process_left, ftkit, losses, mp_lock
    from tests.helpers.runs import write_recipe as recipe_for

    recipe = recipe_for(d, fx)
    with mp_lock():
        r = ftkit("launch", str(recipe), env=RUN_ENV, timeout=RUN_TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = d / "run"
    assert_no_process_left(run)
    got = losses(run)
    assert sorted(got) == list(range(1, RUN_STEPS + 1))
    return {"run": run, "losses": got}


@pytest.fixture
def netns2(tmp_path: Path) -> Iterator[NetnsCluster]:
    """Two namespace hosts (node0, node1) with sshd; skips when the machine cannot run them."""
    require_netns()
    with netns_cluster(2, workdir=tmp_path / "netns") as cluster:
        yield cluster
