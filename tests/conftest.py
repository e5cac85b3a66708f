"""Fixtures shared by every test: a tiny model config on disk and a recipe writer (no heavy imports here). Plain
helpers are in tests/helpers/; the fixtures of the real runs are in tests/integration/conftest.py."""

from __future__ import annotations

import json
import textwrap
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
    # ... and local checkpoint tiers a failed test left (a passing one asserts its run removed its own)
    for p in shm.glob("ftkit-*") if shm.is_dir() else []:
        try:
            if p.is_dir() and p.stat().st_mtime >= _SESSION_START - 1:
                __import__("shutil").rmtree(p, ignore_errors=True)
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
