"""Fixtures of the real multi-process runs: the fixtures model and one uninterrupted reference run (made once per
session), and two namespace hosts. The Slurm cluster is in slurm/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.netns import NetnsCluster, netns_cluster, require_netns

# Real 2-rank runs (tests marked slow): the fixtures model and one uninterrupted reference run, made once per session
# (tests read them and copy what they change: each costs a model build or a 2-rank launch).


@pytest.fixture(scope="session")
def fx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model, tokenizer and learnable data, made once per session (read-only for tests)."""
    from tests.helpers.runs import make_fixtures

    return make_fixtures(tmp_path_factory.mktemp("fixtures"))


@pytest.fixture(scope="session")
def baseline(fx: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted run: its losses are what every recovered run must reproduce; its run directory is
    copied by the corruption tests (checkpoint-8 and checkpoint-12 committed)."""
    from tests.helpers.runs import RUN_ENV, RUN_STEPS, RUN_TIMEOUT_S, assert_no_process_left, ftkit, losses, mp_lock
    from tests.helpers.runs import write_recipe as recipe_for

    d = tmp_path_factory.mktemp("baseline")
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
