"""Issue 11, item 6 with real runs (2 CPU ranks, the tiny model): what the built-in entry's users expect.

An evaluation split (``data.eval``, ``train.eval_steps``: eval loss in metrics.jsonl, ``ftkit status`` and the
plot), TensorBoard event files in the run directory (``train.report_to: [tensorboard]``, offline), and the progress
line of ``ftkit launch``: rewritten in place on a terminal (a real pseudo-terminal here) and plain periodic lines
on a pipe, both with samples/s and an ETA.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from ftkit.run.status import read_jsonl
from tests.helpers.runs import RUN_ENV, RUN_TIMEOUT_S, assert_no_process_left, ftkit, mp_lock
from tests.helpers.runs import write_recipe as _write_recipe

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_eval_split_tensorboard_and_the_progress_line_on_a_pipe(fx, tmp_path):
    recipe = _write_recipe(
        tmp_path, fx, data__eval=str(fx["data"]), train__eval_steps=4, train__report_to=["tensorboard"]
    )
    run = tmp_path / "run"
    with mp_lock():
        r = subprocess.run(  # stdout is a pipe: plain progress lines
            [sys.executable, "-m", "ftkit", "launch", str(recipe)],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env={**os.environ, **RUN_ENV},
        )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    progress = [ln for ln in r.stdout.splitlines() if ln.startswith("progress: ")]
    assert progress, r.stdout[-3000:]
    assert "\r" not in r.stdout and "\x1b[" not in r.stdout  # no terminal control codes in a log
    last = progress[-1]
    assert "step 12/12" in last and "samples/s" in last and "tokens/s" in last and "ETA" in last, last
    assert "-- samples/s" not in last, last  # a measured rate, not a placeholder
    evals = [m for m in read_jsonl(run / "metrics.jsonl") if "eval_loss" in m]
    assert [m["step"] for m in evals] == [4, 8, 12], evals
    assert all(m["eval_loss"] > 0 for m in evals)
    tb = list((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert tb and all(p.stat().st_size > 0 for p in tb), sorted((run).rglob("*tfevents*"))
    status = ftkit("status", str(run), "--plot", str(tmp_path / "loss.png"), timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "eval loss" in status.stdout, status.stdout
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert_no_process_left(run)


@pytest.mark.timeout(600)
def test_the_progress_line_is_rewritten_in_place_on_a_terminal(fx, tmp_path):
    recipe = _write_recipe(tmp_path, fx, train__max_steps=30)
    run = tmp_path / "run"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    out = bytearray()
    with mp_lock():
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftkit", "launch", str(recipe)],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**os.environ, **RUN_ENV, "TERM": "xterm"},
            start_new_session=True,
        )
        os.close(slave)
        end = time.monotonic() + RUN_TIMEOUT_S
        try:
            while time.monotonic() < end:
                ready, _, _ = select.select([master], [], [], 1.0)
                if ready:
                    try:
                        chunk = os.read(master, 65536)
                    except OSError:  # the terminal closed: the process is gone
                        break
                    if not chunk:
                        break
                    out += chunk
                elif proc.poll() is not None:
                    break
            code = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(master)
    text = out.decode(errors="replace")
    assert code == 0, text[-3000:]
    rewrites = [seg for seg in text.split("\r") if seg.startswith("step ")]
    assert len(rewrites) >= 5, text[-3000:]  # the same line, rewritten in place as steps go by
    assert "\x1b[K" in text  # cleared to the end of the line each time
    assert "progress: " not in text  # no plain lines on a terminal
    final = [seg for seg in rewrites if "step 30/30" in seg]
    assert final and "samples/s" in final[-1] and "ETA" in final[-1], rewrites[-3:]
    assert "-- samples/s" not in final[-1]
    assert_no_process_left(run)
