"""Fixtures shared by every test: a tiny model config on disk and a recipe writer (no heavy imports here). Plain
helpers are in tests/helpers/; the fixtures of the real runs are in tests/integration/conftest.py."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.helpers.recipes import MINIMAL, TINY_LLAMA

_SESSION_START = __import__("time").time()

# The planner's activation profile comes from the closed form in tests (and in the runs they start), unless a test
# asks for tracing (FTKIT_PROFILE=auto with its own FTKIT_PROFILE_CACHE): a trace costs a subprocess importing torch
# and transformers (seconds), and the golden outputs must not depend on what a machine has cached.
__import__("os").environ.setdefault("FTKIT_PROFILE", "formula")


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


# The integration tier runs on two pytest-xdist workers (make test: ``-n 2 --dist loadscope``): a module's tests
# stay on one worker, so its module-scoped runs are made once, and the modules whose tests use namespace hosts or the
# Slurm cluster form one unit (their hosts and daemons are machine-wide). ``pytest_collection_modifyitems`` checks
# that the list below names every such module.
HOST_MODULES = frozenset(
    {
        "tests/integration/doctor/test_doctor.py",
        "tests/integration/multinode/test_multinode.py",
        "tests/integration/multinode/test_netns_harness.py",
        "tests/integration/multinode/test_scale.py",
        "tests/integration/slurm/test_slurm.py",
        "tests/integration/stragglers/test_stragglers_multinode.py",
        "tests/integration/tiers/test_peer_copies.py",
    }
)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with the namespace-host and Slurm modules as one scope."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "namespace hosts and Slurm" if module in HOST_MODULES else module

    return ByModule(config, log)


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    for item in items:
        if item.get_closest_marker("multinode") or item.get_closest_marker("slurm"):
            module = item.nodeid.split("::")[0]
            if module not in HOST_MODULES:
                raise pytest.UsageError(f"{module} uses namespace hosts or Slurm: add it to HOST_MODULES in {__file__}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    """Seconds per kind of test (slow, multinode, slurm), summed over the tests that ran: the integration tier runs
    them together on two workers, and these sums say which kind its time went to."""
    spent: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            kw = getattr(rep, "keywords", None)
            if not kw or not hasattr(rep, "duration"):
                continue
            kind = next((k for k in ("slurm", "multinode", "slow") if k in kw), None)
            if kind:
                spent[kind] = spent.get(kind, 0.0) + rep.duration
    if spent:
        terminalreporter.write_line(
            "test seconds by kind (summed): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(spent.items()))
        )


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
