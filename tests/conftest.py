"""Fixtures shared by every test: a tiny model config on disk and a recipe writer (no heavy imports here), and
the multi-host and Slurm clusters. Plain helpers are in tests/helpers/; the real runs' shared fixtures (``fx``,
``baseline``) are here too until the integration tests have their own folder."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.recipes import MINIMAL, TINY_LLAMA

_SESSION_START = __import__("time").time()


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    """Safety net for tests that start DeepSpeed directly (not through ftkit, which removes them itself): drop the
    /dev/shm buffers DeepSpeed's CPU collectives created during this session."""
    shm = Path("/dev/shm")
    for p in shm.glob("deepspeed_allreduce_buffer_*") if shm.is_dir() else []:
        try:
            if p.stat().st_mtime >= _SESSION_START - 1:
                p.unlink()
        except OSError:
            pass


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


@pytest.fixture
def write_recipe(tmp_path: Path, model_dir: Path):
    """Write a recipe (YAML text, dedented) into tmp_path/recipe.yaml; model at ./model, data at ./data.jsonl (a
    one-line file, so `ftkit launch --dry-run`, which checks the data as a launch does, gets past it)."""
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text('{"text": "hello world"}\n')

    def _write(body: str = "", name: str = "recipe.yaml") -> Path:
        text = textwrap.dedent(body) if body else MINIMAL
        p = tmp_path / name
        p.write_text(text)
        return p

    return _write


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
def netns2(tmp_path: Path) -> Iterator:
    """Two namespace hosts (node0, node1) with sshd; skips when the machine cannot run them."""
    from tests.helpers.netns import netns_cluster, require_netns

    require_netns()
    with netns_cluster(2, workdir=tmp_path / "netns") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def slurm2() -> Iterator:
    """A real two-node Slurm cluster (n1, n2), one per module; skips without root."""
    from tests.helpers.slurm import slurm_cluster

    with slurm_cluster() as c:
        yield c
