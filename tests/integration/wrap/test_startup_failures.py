"""Issue 35 (and 36, item 11): a start-up failure a restart cannot change stops at once, with the rank's own line.

Real ``ftkit launch RECIPE -- python SCRIPT`` runs on torchrun, 2 CPU ranks, each script failing before any
training step the way users' scripts do: a module not installed, a data file that is not there, ``sys.exit`` with a
message or a status (SystemExit never reaches an excepthook: these used to be restarted until the budget ran out,
exit 4, the message never shown), and a failure that leaves no record at all (only its log's last line) and repeats
word for word. Each ends with exit 14 and one line: the rank, its host, the exception's own line, its log, and a hint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftkit.errors import ExitCode
from tests.helpers.runs import assert_no_process_left, named, write_recipe
from tests.integration.wrap.test_wrap import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPTS = {  # a module that is not installed: test_wrap.py's test_script_failing_at_import_stops_at_once_with_its_error
    "missing_file": ("open('/no/such/dataset/train.jsonl').read()\n", "missing_file",
                     "FileNotFoundError: [Errno 2] No such file or directory: '/no/such/dataset/train.jsonl'"),
    "exit_message": ("import sys\nsys.exit('dataset /data/set not found')\n", "script_exit",
                     "SystemExit: dataset /data/set not found"),
    "exit_status": ("import sys\nsys.exit(3)\n", "script_exit", "SystemExit: exit status 3"),
}  # fmt: skip


def _run(tmp_path: Path, fx: dict[str, Path], body: str):
    script = tmp_path / "script.py"
    script.write_text(body)
    recipe = write_recipe(tmp_path, fx, train__max_steps=4, cluster__engine="torchrun", cluster__gpus_per_node=1,
                          train__global_batch_size=4)  # fmt: skip
    r = launch(recipe, "--", "python", str(script))
    return r, tmp_path / "run"


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_a_start_up_failure_a_restart_cannot_change_stops_at_once(case, fx, tmp_path):
    body, cls, line = SCRIPTS[case]
    r, run = _run(tmp_path, fx, body)
    assert r.returncode == ExitCode.SCRIPT_FAILED, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(named(run, "launch")) == 1 and not named(run, "restart")
    (failure,) = named(run, "failure")
    assert failure["failure_class"] == cls and failure["restartable"] is False, failure
    (gave_up,) = named(run, "gave_up")
    log = run / "logs" / "attempt-0" / "rank-0.log"
    assert gave_up["message"].startswith("not restarting: rank 0 on "), gave_up
    assert f": {line} (log: {log}): a restart cannot change it ({cls}) [" in gave_up["message"], gave_up
    assert f"ftkit: {gave_up['message']}" in r.stdout
    # stopped at the failure, not at the start-up timeout (900 s): from the attempt's spawn to its failure, as the
    # run's own events time them (the test's wall clock also counted the wait for a run slot: 125 s on a loaded machine)
    (spawn,) = named(run, "spawn")
    took = failure["time"] - spawn["time"]
    assert took < 90, took  # measured ~10 s idle, ~25 s with the integration tier's other worker running
    assert_no_process_left(run)


def test_a_start_up_failure_that_repeats_word_for_word_stops_on_the_second_attempt(fx, tmp_path):
    """No record (the process leaves without Python's exception handling, as an engine or a library's own exit may),
    a cause that could be transient by its type: restarted once, then stopped because it repeated exactly."""
    body = (
        "import os, sys, time\n"
        "print('Traceback (most recent call last):', flush=True)\n"
        "print(f'RuntimeError: the data service at 10.0.0.1:8000 refused us (pid {os.getpid()})', flush=True)\n"
        "os._exit(1)\n"
    )
    r, run = _run(tmp_path, fx, body)
    assert r.returncode == ExitCode.SCRIPT_FAILED, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(named(run, "launch")) == 2 and len(named(run, "restart")) == 1
    failures = named(run, "failure")
    assert [f["failure_class"] for f in failures] == ["exception", "exception"], failures
    (gave_up,) = named(run, "gave_up")
    assert "RuntimeError: the data service at 10.0.0.1:8000 refused us" in gave_up["message"], gave_up
    assert gave_up["message"].endswith("the previous attempt failed the same way before its first step"), gave_up
    assert_no_process_left(run)
