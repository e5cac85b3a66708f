"""Issue 5's acceptance with real processes: 2 CPU ranks, the tiny model, the real ``ftkit launch`` CLI.

Each test kills, freezes, corrupts or interrupts something real, then checks what the supervisor promised:
exit code, the decisions in ``events.jsonl``, losses identical to an uninterrupted run (on CPU a run resumed
from checkpoint k reproduces it exactly), checkpoints left intact, and no process of the run left behind.

The uninterrupted reference run is computed once (deepspeed engine) and reused: the three engines produce the
same losses for the same recipe (measured), so every engine's recovered run is compared with it.
"""

from __future__ import annotations

import shutil
import signal
import socket
from pathlib import Path

import pytest

from ftkit.cluster.procs import is_alive
from ftkit.errors import ExitCode
from tests.helpers.runs import (  # fx and baseline: conftest.py fixtures
    RUN_ENV,
    RUN_STEPS,
    RUN_TIMEOUT_S,
    assert_no_process_left,
    assert_same_losses,
    committed_ok,
    events,
    finish,
    free_port,
    ftkit,
    launched,
    named,
    output,
    rank_record,
    recipe_and_run,
    signal_rank,
    wait_for,
    wait_step,
)

pytestmark = pytest.mark.slow

ENV = RUN_ENV
STEPS = RUN_STEPS
GRACE_S = 10.0  # the supervisor's teardown grace period (Supervisor.grace_s)
RUN_S = RUN_TIMEOUT_S


# ------------------------------------------------------------------------------------------------- 0. the reference

# The baseline recipe's losses as main 17586c7 trained them (2 CPU ranks, ZeRO-2, DeepSpeed building torch's
# AdamW from `torch_adam: true` without `fused`), measured 2026-11-28. Issue 35 renders `fused: true` too (nothing
# to compile on a CUDA host); measured then: the same 12 losses within 1e-7 relative.
LOSSES_17586C7 = {
    1: 6.064582824707031, 2: 5.876913070678711, 3: 5.733615398406982, 4: 5.608792304992676, 5: 5.483445167541504,
    6: 5.345430850982666, 7: 5.252320766448975, 8: 5.122650146484375, 9: 5.022144317626953, 10: 4.940018653869629,
    11: 4.84867525100708, 12: 4.778174877166748,
}  # fmt: skip


def test_the_default_optimizer_trains_as_before(baseline):
    """Issue 35: the optimizer that needs nothing compiled trains the cpu-demo values as the old config did."""
    got = baseline["losses"]
    assert sorted(got) == sorted(LOSSES_17586C7)
    worst = max(abs(got[s] - v) / v for s, v in LOSSES_17586C7.items())
    assert worst < 1e-4, {s: (got[s], v) for s, v in LOSSES_17586C7.items()}


# ------------------------------------------------------------------------------------------------- 1. SIGKILL


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["deepspeed", "accelerate", "torchrun"])
def test_sigkilled_rank_recovers_with_identical_losses(engine, fx, baseline, tmp_path):
    recipe, run = recipe_and_run(tmp_path, fx, cluster__engine=engine)
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
    recipe, run = recipe_and_run(tmp_path, fx)
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
    recipe, run = recipe_and_run(tmp_path, fx)
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
    recipe, run = recipe_and_run(tmp_path, fx, resilience__hang_timeout_s=hang)
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
    recipe, run = recipe_and_run(tmp_path, fx)
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


# The first signal asks for a graceful stop, a second one tears the run down at once: test_graceful_stop.py.


# ------------------------------------------------------------------------------------------------- 7. preflight


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bind_addr", ["127.0.0.1", "0.0.0.0"])
def test_master_port_in_use_fails_preflight_before_anything_starts(bind_addr, fx, tmp_path):
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind_addr, port))
        s.listen()
        recipe, run = recipe_and_run(tmp_path, fx, cluster__master_port=port)
        r = ftkit("launch", str(recipe), env=ENV, timeout=60)
    assert r.returncode == ExitCode.PREFLIGHT, r.stdout + r.stderr
    assert str(port) in r.stderr and "in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not named(run, "spawn") and not (run / "logs").exists()
    assert not (run / "ftkit" / "attempts").exists()
    assert_no_process_left(run)
