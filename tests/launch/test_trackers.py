"""The trackers' state a killed rank can leave behind, for real: mlflow's file store, and wandb's offline runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.launch.trackers import atomic_mlflow_run_info, wandb_records
from ftkit.rundir.layout import RunDir, append_jsonl
from tests.helpers.paths import REPO


@pytest.fixture(autouse=True)
def _mlflow() -> None:
    pytest.importorskip("mlflow")  # a test's skip, not the module's: a missing mlflow fails them (tests/conftest.py)


@pytest.mark.heavy
def test_a_run_info_rewrite_cut_short_leaves_the_mlflow_run_readable(tmp_path, monkeypatch):
    """mlflow rewrites a run's meta.yaml in place when the run ends; a rank killed in the middle (CI saw it: the
    teardown of a failed attempt) left it empty, and the next attempt, resuming that run, failed before its first
    step. With ftkit's patch the interrupted rewrite leaves the run as it was."""
    import yaml
    from mlflow.store.tracking import file_store
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setattr(file_store, "write_yaml", file_store.write_yaml)  # the patch is undone after the test
    atomic_mlflow_run_info(file_store)
    client = MlflowClient(tracking_uri=f"file://{tmp_path}")
    run = client.create_run(client.create_experiment("e"))

    def killed(data, stream=None, **kw):  # the process dies once the file is opened, before anything is written
        raise SystemExit("killed mid-write")

    with monkeypatch.context() as m:
        m.setattr(yaml, "dump", killed)
        with pytest.raises(SystemExit):
            client.set_terminated(run.info.run_id, "KILLED")

    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    assert not [p.name for p in (tmp_path / run.info.experiment_id / run.info.run_id).iterdir() if ".tmp-" in p.name]
    client.set_terminated(run.info.run_id, "FINISHED")  # and a rewrite that completes still lands
    assert client.get_run(run.info.run_id).info.status == "FINISHED"


@pytest.mark.heavy
def test_the_patch_is_applied_once(monkeypatch):
    from mlflow.store.tracking import file_store

    monkeypatch.setattr(file_store, "write_yaml", file_store.write_yaml)
    atomic_mlflow_run_info(file_store)
    first = file_store.write_yaml
    atomic_mlflow_run_info(file_store)
    assert file_store.write_yaml is first and first._ftkit


# One attempt of a job's rank 0 as far as wandb goes: the ids ftkit sets, wandb's own offline run, and for attempt 1
# (resumed at step 2) ftkit's start of the attempt, which logs what the tracker lacks up to the resumed step.
_ATTEMPT = r"""
import json, os, signal, sys
import wandb
from ftkit.launch.trackers import Trackers
from ftkit.rundir.layout import RunDir
run_dir, attempt, end = sys.argv[1], int(sys.argv[2]), sys.argv[3]
trackers = Trackers(RunDir(run_dir), attempt, "checkpoint-2" if attempt else None)
os.environ.update(trackers.environment())
run = wandb.init(project="p")
if attempt == 0:
    for step in range(1, 5):
        run.log({"train/loss": 1.0 / step, "train/global_step": step})
    if end == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
else:
    trackers.start_attempt(0, 2)
    print(json.dumps(sorted(trackers.held["wandb"])), flush=True)
run.finish()
"""


def _wandb_env(tmp_path: Path) -> dict[str, str]:
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    return env


def _attempt(rd: RunDir, attempt: int, end: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", _ATTEMPT, str(rd.path), str(attempt), end]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def _wandb_attempts(tmp_path: Path, end: str) -> tuple[list[int], list[int]]:
    """Attempt 0 logs steps 1-4 and ENDS (``finished``: its offline run fully on disk; ``killed``: SIGKILL right
    after, its wandb-core orphaned); the supervisor records it failed either way; attempt 1 resumes at step 2.
    Returns what attempt 1 found the run holds, and every step logged across both attempts' offline files."""
    env = _wandb_env(tmp_path)
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    for step in range(1, 5):
        append_jsonl(rd.metrics, {"step": step, "attempt": 0, "loss": 1.0 / step, "lr": 1e-3})
    append_jsonl(rd.events, {"event": "spawn", "attempt": 0})
    append_jsonl(rd.events, {"event": "failure", "attempt": 0, "message": "rank 0 killed by SIGKILL"})
    _attempt(rd, 0, end, env)
    second = _attempt(rd, 1, end, env)
    assert second.returncode == 0, second.stderr[-3000:]
    held = json.loads(second.stdout.strip().splitlines()[-1])
    steps = []
    for path in sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                if "train/loss" in row:
                    steps.append(int(row["train/global_step"]))
    return held, sorted(steps)


def _wandb_cores(tmp_path: Path) -> list[int]:
    """The wandb-core processes started for TMP_PATH's runs (their environment names it as WANDB_DIR)."""
    marker = f"WANDB_DIR={tmp_path}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"wandb-core" in (entry / "cmdline").read_bytes():
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.heavy  # wandb's own service processes, several seconds each
def test_a_failed_attempt_whose_offline_run_reached_the_disk_is_not_logged_twice(tmp_path):
    """CI saw it: a killed attempt's wandb-core (a process of its own) had written the steps it was sent before it
    ended, and the resumed attempt, taking a failed attempt's offline run for lost, logged steps 1 and 2 again. Which
    steps the run holds is read from the files on disk."""
    held, steps = _wandb_attempts(tmp_path, "finished")
    assert held == [1, 2, 3, 4]
    assert steps == [1, 2, 3, 4]


@pytest.mark.heavy  # wandb's own service processes, several seconds each
def test_a_killed_attempt_whose_offline_run_was_lost_is_logged_again_up_to_the_resumed_step(tmp_path):
    """The usual end of a SIGKILLed rank: its wandb-core ends without writing what it held. Attempt 1 waits for it
    (and would kill it), then logs the steps up to where it resumes from metrics.jsonl (3 and 4 it recomputes)."""
    held, steps = _wandb_attempts(tmp_path, "killed")
    assert held == [1, 2]
    assert steps == [1, 2]
    assert _wandb_cores(tmp_path) == []


@pytest.mark.heavy  # wandb's own service processes, several seconds each
def test_a_wandb_file_cut_short_yields_the_records_before_the_cut(tmp_path):
    """A writer killed mid-block leaves a chunk cut short: the reader stops there and keeps what came before."""
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    assert _attempt(rd, 0, "finished", _wandb_env(tmp_path)).returncode == 0
    path = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    data = path.read_bytes()
    whole = list(wandb_records(path))
    path.write_bytes(data[: len(data) - 5])
    cut = list(wandb_records(path))
    assert 0 < len(cut) < len(whole)
    assert [r.SerializeToString() for r in cut] == [r.SerializeToString() for r in whole[: len(cut)]]
    path.write_bytes(data[:7] + bytes([data[7] ^ 0xFF]) + data[8:])  # a wrong checksum on the first chunk
    assert list(wandb_records(path)) == []
