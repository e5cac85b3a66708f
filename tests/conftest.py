"""Shared fixtures: tiny model configs on disk and recipe writers (no heavy imports here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from netns import netns2  # noqa: F401 - the two-host fixture, for tests/test_multinode.py

REPO = Path(__file__).resolve().parent.parent
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
    # ... and local checkpoint tiers a failed test left (a passing one asserts its run removed its own)
    for p in shm.glob("ftkit-*") if shm.is_dir() else []:
        try:
            if p.is_dir() and p.stat().st_mtime >= _SESSION_START - 1:
                __import__("shutil").rmtree(p, ignore_errors=True)
        except OSError:
            pass


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


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


MINIMAL = """\
model:
  path: ./model
data:
  train: ./data.jsonl
train:
  output_dir: ./run
  micro_batch_size: 2
  global_batch_size: 16
cluster:
  gpus_per_node: 8
"""


def run_ftkit(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 60):
    """Run the real `ftkit` command line in a subprocess (as a user would)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ftkit", *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout
    )


# Real 2-rank runs (tests marked slow): the fixtures model and one uninterrupted reference run, made once per session
# (tests read them and copy what they change: each costs a model build or a 2-rank launch).
RUN_ENV = {"DS_ACCELERATOR": "cpu"}
RUN_STEPS = 12  # tests.runs.write_recipe's default: checkpoints every 4 steps, the newest 2 kept
RUN_TIMEOUT_S = 240  # an upper bound for one whole `ftkit launch` with a restart or two (a clean run takes ~15 s)


@pytest.fixture(scope="session")
def fx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model, tokenizer and learnable data, made once per session (read-only for tests)."""
    from tests.runs import make_fixtures

    return make_fixtures(tmp_path_factory.mktemp("fixtures"))


@pytest.fixture(scope="session")
def baseline(fx: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted run: its losses are what every recovered run must reproduce; its run directory is
    copied by the corruption tests (checkpoint-8 and checkpoint-12 committed)."""
    from tests.runs import assert_no_process_left, ftkit, losses, mp_lock
    from tests.runs import write_recipe as recipe_for

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
