"""The trackers' state a killed rank can leave behind: mlflow's file store, for real."""

from __future__ import annotations

import pytest

from ftkit.launch.callback import atomic_mlflow_run_info

mlflow = pytest.importorskip("mlflow")


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


def test_the_patch_is_applied_once(monkeypatch):
    from mlflow.store.tracking import file_store

    monkeypatch.setattr(file_store, "write_yaml", file_store.write_yaml)
    atomic_mlflow_run_info(file_store)
    first = file_store.write_yaml
    atomic_mlflow_run_info(file_store)
    assert file_store.write_yaml is first and first._ftkit
