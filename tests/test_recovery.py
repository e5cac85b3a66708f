"""Issue 5's acceptance with real processes: 2 CPU ranks, the tiny model, the real ``ftkit launch`` CLI.

Each test kills, freezes, corrupts or interrupts something real, then checks what the supervisor promised:
exit code, the decisions in ``events.jsonl``, losses identical to an uninterrupted run (on CPU a run resumed
from checkpoint k reproduces it exactly), checkpoints left intact, and no process of the run left behind.

The uninterrupted reference run is computed once (deepspeed engine) and reused: the three engines produce the
same losses for the same recipe (measured), so every engine's recovered run is compared with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftkit.checkpoint.verify import verify
from ftkit.cluster.procs import is_alive
from ftkit.errors import ExitCode
from ftkit.rundir.layout import RunDir
from tests.runs import (
    assert_no_process_left,
    events,
    free_port,
    ftkit,
    heartbeat_step,
    kill_tree,
    losses,
    mp_lock,
    named,
    rank_pid,
    start_ftkit,
    wait_for,
)
from tests.runs import write_recipe as _write_recipe  # conftest has a fixture of the same name

from conftest import RUN_ENV, RUN_STEPS, RUN_TIMEOUT_S  # fx and baseline: conftest's module fixtures

pytestmark = pytest.mark.slow

ENV = RUN_ENV
STEPS = RUN_STEPS
GRACE_S = 10.0  # the supervisor's teardown grace period (Supervisor.grace_s)
RUN_S = RUN_TIMEOUT_S


# ------------------------------------------------------------------------------------------------- fixtures


# ------------------------------------------------------------------------------------------------- helpers


def _recipe(tmp_path: Path, fx: dict[str, Path], **overrides: Any) -> tuple[Path, Path]:
    recipe = _write_recipe(tmp_path, fx, **overrides)
    return recipe, tmp_path / "run"


def _kill_leftovers(run: Path) -> None:
    """After a failed test: SIGKILL what the run recorded (launcher groups, ranks, agents), by pid only."""
    for e in events(run):
        if e.get("event") == "spawn":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(e["pid"]), signal.SIGKILL)
    rd = RunDir(run)
    for attempt_dir in (rd.meta / "attempts").glob("*"):
        if not attempt_dir.name.isdigit():
            continue
        for rec in rd.records("pids", int(attempt_dir.name)):
            for pid, st in ((rec["pid"], rec.get("start_time")), (rec.get("ppid"), rec.get("ppid_start_time"))):
                if pid and st and is_alive(int(pid), st):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def launched(recipe: Path, run: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """``ftkit launch RECIPE ARGS`` in the background, under the multi-process lock; cleaned up if the test fails."""
    with mp_lock():
        proc = start_ftkit("launch", str(recipe), *args, env={**ENV, **(env or {})}, log=recipe.parent / "ftkit.log")
        try:
            yield proc
        except BaseException:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the supervisor's own teardown first
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(40)
            kill_tree(proc)
            _kill_leftovers(run)
            raise


def finish(proc: subprocess.Popen, timeout: float = RUN_S) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ftkit launch still running after {timeout}s") from None


def output(recipe: Path) -> str:
    p = recipe.parent / "ftkit.log"
    return p.read_text(errors="replace") if p.exists() else ""


def wait_step(run: Path, rank: int, step: int, attempt: int = 0, timeout: float = 180) -> None:
    wait_for(lambda: heartbeat_step(run, rank, attempt) >= step, timeout, f"rank {rank} at step {step}")


def rank_record(run: Path, rank: int, attempt: int = 0) -> dict[str, Any]:
    pid = rank_pid(run, rank, attempt)
    assert pid is not None, f"no pid record for rank {rank}"
    rec = next(r for r in RunDir(run).records("pids", attempt) if r["rank"] == rank)
    assert is_alive(pid, rec.get("start_time")), f"rank {rank} pid {pid} is not running"
    return rec


def signal_rank(run: Path, rank: int, sig: int, attempt: int = 0) -> float:
    """Signal a rank from outside, by the pid it recorded (checked against its start time); returns when."""
    rec = rank_record(run, rank, attempt)
    t = time.time()
    os.kill(int(rec["pid"]), sig)
    return t


def assert_same_losses(run: Path, expected: dict[int, float], steps: range | None = None) -> None:
    got = losses(run)
    steps = steps or range(1, STEPS + 1)
    assert sorted(set(steps) - set(got)) == [], f"steps without a loss: {sorted(set(steps) - set(got))}"
    diffs = {s: (got[s], expected[s]) for s in steps if abs(got[s] - expected[s]) > 1e-6}
    assert not diffs, f"losses differ from the uninterrupted run (step: got, expected): {diffs}"


def committed_ok(ckpt: Path) -> bool:
    v = verify(ckpt, checksums=True, require_commit=True)
    return v.ok and v.committed


# ------------------------------------------------------------------------------------------------- 1. SIGKILL


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["deepspeed", "accelerate", "torchrun"])
def test_sigkilled_rank_recovers_with_identical_losses(engine, fx, baseline, tmp_path):
    recipe, run = _recipe(tmp_path, fx, cluster__engine=engine)
    with launched(recipe, run) as proc:
        wait_step(run, 1, 6)
        signal_rank(run, 1, signal.SIGKILL)
        code = finish(proc)
        assert code == ExitCode.OK, output(recipe)[-3000:]
    assert [e["engine"] for e in named(run, "launch")] == [engine, engine]  # the engine asked for, both attempts
    restarts = named(run, "restart")
    assert len(restarts) == 1, restarts
    (failure,) = named(run, "failure")
    assert failure["attempt"] == 0 and failure["kind"] == "exit"
    assert 1 in failure["dead_ranks"], failure
    chosen = [e for e in named(run, "checkpoint_chosen") if e["attempt"] == 1]
    assert [Path(e["checkpoint"]).name for e in chosen] == ["checkpoint-4"], chosen
    assert_same_losses(run, baseline["losses"])
    assert named(run, "finished")
    assert_no_process_left(run)


# ------------------------------------------------------------------------------------------------- 2. torn save


@pytest.mark.timeout(600)
def test_rank_killed_while_saving_torn_checkpoint_is_set_aside(fx, baseline, tmp_path):
    recipe, run = _recipe(tmp_path, fx)
    with launched(recipe, run, env={"FTKIT_FAULT_INJECT": "kill_in_save:1:8"}) as proc:
        code = finish(proc)
        assert code == ExitCode.OK, output(recipe)[-3000:]
    assert len(named(run, "restart")) == 1
    rejected = [e for e in named(run, "checkpoint_rejected") if e["attempt"] == 1]
    assert [Path(e["checkpoint"]).name for e in rejected] == ["checkpoint-8"], rejected
    assert rejected[0]["kind"] == "no_commit" and "no commit record" in rejected[0]["reason"], rejected
    aside = [e for e in named(run, "set_aside") if e["attempt"] == 1]
    assert len(aside) == 1 and Path(aside[0]["dst"]).name.startswith("checkpoint-8.rejected-"), aside
    # Kept out of the checkpoint-N namespace, and deleted once a newer committed checkpoint exists: set-aside
    # copies must not keep eating the disk.
    assert not Path(aside[0]["dst"]).exists()
    chosen = [e for e in named(run, "checkpoint_chosen") if e["attempt"] == 1]
    assert [Path(e["checkpoint"]).name for e in chosen] == ["checkpoint-4"], chosen
    assert_same_losses(run, baseline["losses"])
    assert committed_ok(run / "checkpoint-8") and committed_ok(run / "checkpoint-12")  # written again, whole
    assert_no_process_left(run)


# ------------------------------------------------------------------------------------------------- 3. corruption


def _truncate_shard(ckpt: Path) -> None:
    shard = sorted((ckpt / "global_step12").glob("*optim_states.pt"))[0]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)


def _delete_trainer_state(ckpt: Path) -> None:
    (ckpt / "trainer_state.json").unlink()


def _flip_mid_shard(ckpt: Path) -> None:
    """16 bytes inverted in the middle of an optimizer shard, size unchanged (a sampled digest missed this)."""
    shard = sorted((ckpt / "global_step12").glob("*optim_states.pt"))[-1]
    middle = shard.stat().st_size // 2
    with open(shard, "r+b") as fh:
        fh.seek(middle)
        data = fh.read(16)
        fh.seek(middle)
        fh.write(bytes(b ^ 0xFF for b in data))


def _dangling_latest(ckpt: Path) -> None:
    # Same length as "global_step12": the size check passes, so the tag itself must be checked.
    (ckpt / "latest").write_text("global_step99")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("corrupt", "why"),
    [
        (_truncate_shard, "commit record says"),
        (_flip_mid_shard, "checksum"),
        (_delete_trainer_state, "trainer_state.json is listed in the commit record but missing"),
        (_dangling_latest, "names global_step99 which does not exist"),
    ],
    ids=["shard", "flipped-bytes", "trainer_state", "latest"],
)
def test_corrupted_newest_checkpoint_resumes_from_older_valid_one(corrupt, why, fx, baseline, tmp_path):
    recipe, run = _recipe(tmp_path, fx)
    shutil.copytree(baseline["run"], run, symlinks=True)
    assert (run / "latest").exists() is False and (run / "checkpoint-12" / "latest").read_text() == "global_step12"
    corrupt(run / "checkpoint-12")
    first = len(events(run))
    with launched(recipe, run, "train.max_steps=16") as proc:
        code = finish(proc)
        assert code == ExitCode.OK, output(recipe)[-3000:]
    new = events(run)[first:]
    rejected = [e for e in new if e["event"] == "checkpoint_rejected"]
    assert [Path(e["checkpoint"]).name for e in rejected] == ["checkpoint-12"], rejected
    assert why in rejected[0]["reason"] and rejected[0]["kind"] == "torn", rejected
    chosen = [e for e in new if e["event"] == "checkpoint_chosen"]
    assert [Path(e["checkpoint"]).name for e in chosen] == ["checkpoint-8"] and chosen[0]["step"] == 8, chosen
    assert [e for e in new if e["event"] == "set_aside"], "the corrupted checkpoint was not moved aside"
    assert not named(run, "restart")
    fin = [e for e in new if e["event"] == "finished"]
    assert fin and fin[0]["step"] == 16, fin
    # Steps 9..12 were trained again from checkpoint-8: the same numbers as the first time.
    assert_same_losses(run, baseline["losses"], range(9, STEPS + 1))
    assert committed_ok(run / "checkpoint-16")
    assert_no_process_left(run)


# ------------------------------------------------------------------------------------------------- 4. SIGSTOP


@pytest.mark.timeout(600)
def test_stopped_rank_is_detected_as_hang_and_killed(fx, baseline, tmp_path):
    hang = 10  # steps take ~0.15 s and a save ~1 s here: 10 s of no progress is a hang
    recipe, run = _recipe(tmp_path, fx, resilience__hang_timeout_s=hang)
    with launched(recipe, run) as proc:
        wait_step(run, 1, 5)
        stopped = rank_record(run, 1)
        t_stop = signal_rank(run, 1, signal.SIGSTOP)
        failure = wait_for(lambda: named(run, "failure"), hang + 60, "the hang to be detected", poll=0.2)[0]
        detected_s = failure["time"] - t_stop
        code = finish(proc)
        assert code == ExitCode.OK, output(recipe)[-3000:]
    assert failure["kind"] == "hang" and failure["attempt"] == 0, failure
    assert hang - 1 <= detected_s <= hang + 10, f"hang detected {detected_s:.1f}s after SIGSTOP (timeout {hang}s)"
    # The frozen rank was stopped by teardown, not left behind (SIGTERM alone does not end a stopped process).
    assert not is_alive(int(stopped["pid"]), stopped["start_time"])
    (td,) = [e for e in named(run, "teardown") if e["attempt"] == 0]
    assert td["clean"], td
    # ... and within the grace period: SIGTERM is followed by SIGCONT, so the stopped rank acts on it.
    assert td["time"] - failure["time"] < GRACE_S, f"teardown took {td['time'] - failure['time']:.1f}s: {td}"
    assert f"rank 1 {stopped['pid']}" not in td["killed"], td
    assert len(named(run, "restart")) == 1
    assert_same_losses(run, baseline["losses"])
    assert_no_process_left(run)


# ------------------------------------------------------------------------------------------------- 5. budget


@pytest.mark.timeout(600)
def test_rank_failing_at_the_same_step_every_time_gives_up_and_keeps_checkpoints(fx, tmp_path):
    recipe, run = _recipe(tmp_path, fx)
    with launched(recipe, run, env={"FTKIT_FAULT_INJECT": "exit:1:6:every"}) as proc:
        code = finish(proc)
    assert code == ExitCode.BUDGET_EXHAUSTED, output(recipe)[-3000:]
    (gave_up,) = named(run, "gave_up")
    assert "giving up" in gave_up["message"] or "exhausted" in gave_up["message"], gave_up
    failures = named(run, "failure")
    assert len(failures) >= 2 and all(f["step"] == 6 and f["kind"] == "exit" for f in failures), failures
    assert committed_ok(run / "checkpoint-4")
    assert not named(run, "set_aside") and not list(run.glob("checkpoint-*.rejected-*"))
    assert not (run / "final").exists()
    assert_no_process_left(run)


# ------------------------------------------------------------------------------------------------- 6. signals


# The first signal asks for a graceful stop, a second one tears the run down at once: tests/test_graceful_stop.py.


# ------------------------------------------------------------------------------------------------- 7. preflight


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bind_addr", ["127.0.0.1", "0.0.0.0"])
def test_master_port_in_use_fails_preflight_before_anything_starts(bind_addr, fx, tmp_path):
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind_addr, port))
        s.listen()
        recipe, run = _recipe(tmp_path, fx, cluster__master_port=port)
        r = ftkit("launch", str(recipe), env=ENV, timeout=60)
    assert r.returncode == ExitCode.PREFLIGHT, r.stdout + r.stderr
    assert str(port) in r.stderr and "in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not named(run, "spawn") and not (run / "logs").exists()
    assert not (run / "ftkit" / "attempts").exists()
    assert_no_process_left(run)
