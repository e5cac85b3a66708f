"""The supervisor's decisions without spawning anything: failure kind x history -> restart / shrink / stop, startup
and hang detection on a fake clock, and resume fidelity."""

from __future__ import annotations

import math
import random
import signal
import time

import pytest

from ftkit.errors import ExitCode
from ftkit.recipe.schema import SECTION_BY_NAME
from ftkit.rundir.sections import ResilienceSection
from ftkit.supervise.decide import (
    NO_PROGRESS_LIMIT,
    Action,
    FailureKind,
    Progress,
    RestartPolicy,
    Situation,
    decide,
    interrupted_code,
)
from ftkit.supervise.fidelity import FidelityCheck


def policy(**kw) -> RestartPolicy:
    base = {"max_restarts": 3, "backoff_s": 10, "backoff_max_s": 25, "rng": random.Random(0)}
    return RestartPolicy(**{**base, **kw})


def test_restart_policy_budget_backoff_and_no_progress():
    p = policy()
    d1 = p.on_failure(step=7, newest_commit=4)
    assert d1.restart and d1.action is Action.RESTART and 5.0 <= d1.delay_s <= 10.0
    d2 = p.on_failure(step=11, newest_commit=8)  # progress since: a new incident, not a repeat
    assert d2.restart and 10.0 <= d2.delay_s <= 20.0
    d3 = p.on_failure(step=15, newest_commit=12)
    assert d3.restart and 12.5 <= d3.delay_s <= 25.0  # capped at backoff_max_s
    d4 = p.on_failure(step=19, newest_commit=16)
    assert not d4.restart and d4.exit_code == ExitCode.BUDGET_EXHAUSTED and "3 of 3" in d4.reason


def test_restart_policy_gives_up_on_repeats_without_progress():
    p = policy(max_restarts=10, backoff_s=0, backoff_max_s=0)
    decisions = [p.on_failure(step=6, newest_commit=4) for _ in range(NO_PROGRESS_LIMIT + 1)]
    assert all(d.restart for d in decisions[:-1])
    assert not decisions[-1].restart and "no new committed checkpoint" in decisions[-1].reason
    assert decisions[-1].exit_code == ExitCode.BUDGET_EXHAUSTED


@pytest.mark.parametrize("kind", [FailureKind.EXIT, FailureKind.HANG, FailureKind.STARTUP])
def test_restartable_failures_restart_within_budget(kind):
    p = policy()
    d = decide(Situation(kind, step=5, newest_commit=4), p)
    assert d.action is Action.RESTART and d.exit_code == ExitCode.OK and p.used == 1


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        (FailureKind.USER_ERROR, ExitCode.USAGE),
        (FailureKind.NO_SPACE, ExitCode.NO_SPACE),
        (FailureKind.RESUME_MISMATCH, ExitCode.RESUME_MISMATCH),
        (FailureKind.SCRIPT_ERROR, ExitCode.SCRIPT_FAILED),
        (FailureKind.STOPPED, ExitCode.STOPPED),
    ],
)
def test_failures_a_restart_cannot_fix_stop_at_once_without_using_the_budget(kind, code):
    p = policy()
    d = decide(Situation(kind, step=5, newest_commit=4), p)
    assert d.action is Action.STOP and d.exit_code == code and p.used == 0


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_interrupted_stops_with_128_plus_signal(sig, code):
    d = decide(Situation(FailureKind.INTERRUPTED, signum=sig), policy())
    assert d.action is Action.STOP and d.exit_code == code == interrupted_code(sig)
    assert sig.name in d.reason


def test_a_finished_graceful_stop_exits_8_naming_the_committed_step():
    d = decide(Situation(FailureKind.STOPPED, step=14, newest_commit=14, signum=signal.SIGUSR1), policy())
    assert d.action is Action.STOP and d.exit_code == ExitCode.STOPPED == 8
    assert "SIGUSR1" in d.reason and "checkpoint committed at step 14" in d.reason


def test_lost_host_with_all_nodes_required_stops_with_host_lost():
    p = policy()
    d = decide(Situation(FailureKind.HANG, step=9, lost_hosts=("node1",), nodes=2, min_nodes=None), p)
    assert d.action is Action.STOP and d.exit_code == ExitCode.HOST_LOST and p.used == 0
    assert "null (all nodes)" in d.reason


def test_lost_host_within_min_nodes_shrinks_and_counts_a_restart():
    p = policy()
    d = decide(Situation(FailureKind.EXIT, step=9, lost_hosts=("node1",), nodes=2, min_nodes=1), p)
    assert d.action is Action.SHRINK and d.restart and p.used == 1


def test_losing_every_host_stops_even_with_min_nodes_zero():
    d = decide(Situation(FailureKind.EXIT, lost_hosts=("a", "b"), nodes=2, min_nodes=0), policy())
    assert d.action is Action.STOP and d.exit_code == ExitCode.HOST_LOST


def test_shrink_still_respects_the_budget():
    p = policy(max_restarts=0)
    d = decide(Situation(FailureKind.EXIT, lost_hosts=("node1",), nodes=3, min_nodes=2), p)
    assert d.action is Action.STOP and d.exit_code == ExitCode.BUDGET_EXHAUSTED


def test_progress_startup_timeout_on_a_fake_clock():
    pr = Progress(started=100.0, startup_timeout_s=30, hang_timeout_s=10)
    pr.observe([{"rank": 0, "phase": "loading", "step": None, "time": 1}], now=105)
    assert pr.failure(now=129, step=None) is None
    kind, msg = pr.failure(now=131, step=None)
    assert kind is FailureKind.STARTUP and "ranks heard from: [0]" in msg


def test_progress_hang_is_timed_on_the_supervisor_clock_not_the_heartbeat_time():
    pr = Progress(started=0.0, startup_timeout_s=30, hang_timeout_s=10)
    pr.observe([{"rank": 0, "phase": "train", "step": 3, "time": 99999}], now=5)  # a rank clock far ahead
    assert pr.failure(now=14, step=3) is None
    pr.observe([{"rank": 0, "phase": "train", "step": 3, "time": 99999}], now=14)  # unchanged: no progress
    kind, msg = pr.failure(now=15.5, step=3)
    assert kind is FailureKind.HANG and "at step 3" in msg
    pr.observe([{"rank": 0, "phase": "train", "step": 4, "time": 1}], now=16)  # changed, even if "older"
    assert pr.failure(now=25, step=4) is None


def test_progress_ignores_malformed_heartbeats():
    pr = Progress(started=0.0, startup_timeout_s=30, hang_timeout_s=10)
    pr.observe([{"phase": "train", "step": 1}, {"rank": "x", "phase": "train", "step": 1}], now=1)
    assert not pr.first_step_seen


def metrics(*rows):
    return [{"step": s, "loss": loss, "grad_norm": g, "attempt": a} for s, loss, g, a in rows]


def test_fidelity_identical_recomputed_steps_pass():
    fc = FidelityCheck.from_metrics(metrics((5, 2.0, 1.0, 0), (6, 1.9, 0.9, 0)), 1, 0.0, 1, resume_step=4)
    assert fc.observe({"step": 5, "loss": 2.0, "grad_norm": 1.0, "attempt": 1}) == []


def test_fidelity_small_difference_warns_large_difference_stops():
    fc = FidelityCheck.from_metrics(metrics((5, 2.0, 1.0, 0), (6, 4.41, 0.9, 0)), 1, 0.01, 1, resume_step=4)
    (warn,) = fc.observe({"step": 5, "loss": 2.05, "grad_norm": 1.0})
    assert warn.what == "loss" and not warn.stop and 0.01 < warn.rel < 0.1
    (stop,) = fc.observe({"step": 6, "loss": 6.12, "grad_norm": 0.9})
    assert stop.stop and "attempt 0 logged 4.41" in stop.message(0.01)


def test_fidelity_skips_the_shorter_first_logging_window_and_new_steps():
    logged = metrics((8, 3.0, 1.0, 0), (12, 2.0, 1.0, 0))
    fc = FidelityCheck.from_metrics(logged, 1, 0.0, 4, resume_step=10)
    assert fc.observe({"step": 12, "loss": 9.0, "grad_norm": 1.0}) == []  # window (10, 12] vs (8, 12]
    assert fc.observe({"step": 16, "loss": 9.0}) == []  # never logged before


def test_fidelity_off_for_a_fresh_start_and_reads_only_earlier_attempts():
    fc = FidelityCheck.from_metrics(metrics((5, 2.0, 1.0, 0)), 1, 0.0, 1, resume_step=None)
    assert fc.observe({"step": 5, "loss": 3.0}) == []
    fc = FidelityCheck.from_metrics(metrics((5, 2.0, 1.0, 1)), 1, 0.0, 1, resume_step=4)  # same attempt: not history
    assert fc.observe({"step": 5, "loss": 3.0}) == []


@pytest.mark.parametrize("logged", [math.inf, -math.inf, math.nan, 2.0], ids=["inf", "-inf", "nan", "finite"])
@pytest.mark.parametrize("now", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_fidelity_a_loss_that_is_not_finite_never_matches(logged, now):
    """Issue 41 point 4: ``inf`` recomputed as ``inf`` counted as reproduced (``a == b`` came first). Even with no
    tolerance to spare, any non-finite loss is a mismatch that stops the run."""
    for tol in (0.0, 0.5):
        fc = FidelityCheck.from_metrics(metrics((5, logged, 1.0, 0)), 1, tol, 1, resume_step=4)
        (mm,) = fc.observe({"step": 5, "loss": now, "grad_norm": 1.0, "attempt": 1})
        assert mm.what == "loss" and mm.stop and mm.rel == math.inf, mm
        assert "not finite" in mm.message(tol), mm.message(tol)


def test_fidelity_the_same_overflowed_grad_norm_matches_but_a_new_one_does_not():
    """fp16 loss scaling: a step whose gradient norm overflowed overflows again when recomputed (the step is skipped
    both times); a gradient norm that turns inf only after the resume is a mismatch."""
    fc = FidelityCheck.from_metrics(metrics((5, 2.0, math.inf, 0), (6, 1.9, 0.9, 0)), 1, 0.0, 1, resume_step=4)
    assert fc.observe({"step": 5, "loss": 2.0, "grad_norm": math.inf}) == []
    (mm,) = fc.observe({"step": 6, "loss": 1.9, "grad_norm": math.inf})
    assert mm.what == "grad_norm" and mm.stop


@pytest.mark.parametrize("loss", [math.inf, math.nan], ids=["inf", "nan"])
def test_the_supervisor_stops_a_resume_that_recomputes_a_loss_that_is_not_finite(tmp_path, loss):
    """The supervisor's own watch loop, on a real run directory: attempt 0 logged step 5 as ``inf`` (or ``nan``),
    the resumed attempt 1 recomputes it the same. The first poll reports a resume mismatch (exit 9), a
    ``resume_mismatch`` event says why; before the fix ``inf == inf`` passed and the loop waited on."""
    import json

    from ftkit.rundir.layout import RunDir

    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    with open(rd.metrics, "w") as f:
        for step in (4, 5):
            f.write(json.dumps({"step": step, "loss": 2.0 if step == 4 else loss, "grad_norm": 1.0, "attempt": 0}))
            f.write("\n")
    sup = _supervisor(rd, world_size=2)  # the observer reads metrics.jsonl from here on, as a relaunch does
    sup._start_fidelity(1, resume_step=4)
    with open(rd.metrics, "a") as f:
        f.write(json.dumps({"step": 5, "loss": loss, "grad_norm": 1.0, "attempt": 1}) + "\n")
    failure = sup.monitor([], 1, time.monotonic())
    assert failure is not None and failure.kind is FailureKind.RESUME_MISMATCH, failure
    assert "step 5 recomputed after the resume: loss" in failure.message and "not finite" in failure.message
    assert decide(Situation(failure.kind, step=5), policy()).exit_code == ExitCode.RESUME_MISMATCH
    events = [json.loads(x) for x in rd.events.read_text().splitlines()]
    (mm,) = [e for e in events if e["event"] == "resume_mismatch"]
    assert mm["step"] == 5 and mm["stop"] is True and mm["metric"] == "loss", mm


def test_an_exception_between_spawn_and_teardown_still_tears_the_run_down(tmp_path, monkeypatch):
    """The supervisor's script runs teardown in a finally: a bug in monitoring must not leave ranks holding GPUs.
    The engine is a stand-in (a real process group of `sleep`); the script and the teardown are the real ones."""
    import subprocess
    import sys

    from ftkit.cluster.procs import group_exists
    from ftkit.command.engines import LaunchCommand, NodeCommand
    from ftkit.rundir.layout import RunDir
    from ftkit.supervise import supervisor as supervise

    started: list[int] = []

    def fake_build(inputs, env):  # noqa: ARG001
        argv = (sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])")  # a leader and a child
        return LaunchCommand("stand-in", (NodeCommand("localhost", 0, argv, {}),))

    def broken_monitor(self, procs, attempt, started_at):  # noqa: ARG001
        started.append(procs[0].proc.pid)
        raise RuntimeError("a bug in monitoring")

    monkeypatch.setattr(supervise, "build_launch", fake_build)
    monkeypatch.setattr(supervise.Supervisor, "monitor", broken_monitor)
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    sup = _supervisor(rd, world_size=1, grace_s=2.0)
    with pytest.raises(RuntimeError, match="a bug in monitoring"):
        sup.run(first=sup.resume.select())
    assert started and not group_exists(started[0]), "the engine's process group outlived the exception"
    assert subprocess.run(["pgrep", "-g", str(started[0])], capture_output=True).returncode == 1


def _supervisor(rd, world_size: int, **kw):
    """A real Supervisor on one local host (nothing spawned until run())."""
    from ftkit.command.engines import LaunchInputs
    from ftkit.supervise import supervisor as supervise

    hosts = (("localhost", world_size),)
    inputs = LaunchInputs("deepspeed", hosts, "127.0.0.1", 29500, str(rd.path), 0, None, "cpu", "py", "t")
    config = supervise.SupervisorConfig(
        rd=rd,
        inputs=inputs,
        base_env={},
        resilience=ResilienceSection(
            **{
                **{f.name: f.default for f in SECTION_BY_NAME["resilience"].fields},
                **{"max_restarts": 1, "backoff_s": 0, "backoff_max_s": 0, "startup_timeout_s": 5, "hang_timeout_s": 5},
            }
        ),
        stage=2,
        world_size=world_size,
        max_steps=4,
        ssh_args=[],
        echo=lambda s: None,
        **kw,
    )
    return supervise.Supervisor(config)


def test_messages_never_say_step_none_and_a_stop_before_any_save_starts_over():
    """A stop before any save used to say "ftkit launch resumes from it" (there was nothing to resume from), and a
    failure before the first step read "at step None"."""
    d = decide(Situation(FailureKind.STOPPED, signum=signal.SIGTERM), policy())
    assert d.exit_code == ExitCode.STOPPED and "starts over" in d.reason and "resumes from it" not in d.reason
    d = decide(Situation(FailureKind.STOPPED, signum=signal.SIGTERM, newest_commit=8), policy())
    assert "checkpoint committed at step 8; ftkit launch resumes from it" in d.reason
    p = policy()
    reasons = [p.on_failure(None, None).reason for _ in range(NO_PROGRESS_LIMIT + 1)]
    assert "before the first step" in reasons[-1] and "None" not in " ".join(reasons)
    prog = Progress(started=0.0, startup_timeout_s=100, hang_timeout_s=5)
    prog.observe([{"rank": 0, "phase": "train", "step": 3, "time": 1}], now=1.0)
    kind, message = prog.failure(now=10.0, step=None)  # the heartbeats were gone by the time it was named
    assert kind is FailureKind.HANG and "None" not in message and "before the first step" in message


# ------------------------------------------------------------------------------------------------ issue 35: causes


def _startup(cause: str, restartable: bool, signature: str | None, step: int | None = None) -> Situation:
    line = f"rank 0 on node0: {signature or cause} (log: /run/logs/attempt-0/rank-0.log)"
    return Situation(FailureKind.EXIT, step=step, cause=cause, restartable=restartable, signature=signature,
                     cause_line=line, hint="the hint")  # fmt: skip


def test_a_start_up_failure_a_restart_cannot_change_stops_at_once_with_the_rank_s_line():
    p = policy()
    d = decide(_startup("op_build", False, "OSError: CUDA_HOME environment variable is not set"), p)
    assert d.action is Action.STOP and d.exit_code == ExitCode.SCRIPT_FAILED and p.used == 0
    assert d.reason == (
        "not restarting: rank 0 on node0: OSError: CUDA_HOME environment variable is not set (log: "
        "/run/logs/attempt-0/rank-0.log): a restart cannot change it (op_build) [the hint]"
    )


def test_a_restartable_start_up_failure_restarts_once_and_stops_when_it_repeats_word_for_word():
    p = policy()
    assert decide(_startup("exception", True, "RuntimeError: boom"), p).restart
    assert decide(_startup("exception", True, "RuntimeError: other"), p).restart  # another cause: a new incident
    d = decide(_startup("exception", True, "RuntimeError: other"), p)
    assert d.action is Action.STOP and d.exit_code == ExitCode.SCRIPT_FAILED and p.used == 2
    assert d.reason.endswith("the previous attempt failed the same way before its first step [the hint]")


@pytest.mark.parametrize("cause", ["killed", "comm_error", "gpu_error", "hang"])
def test_transient_causes_restart_even_when_they_repeat(cause):
    p = policy(max_restarts=5, backoff_s=0, backoff_max_s=0)
    assert all(decide(_startup(cause, True, None), p).restart for _ in range(2))  # no signature: never "the same"
    p = policy(max_restarts=5, backoff_s=0, backoff_max_s=0)
    assert decide(_startup(cause, False, "X: y", step=7), p).restart  # after the first step: restarted
