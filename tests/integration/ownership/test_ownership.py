"""Issue 10's acceptance with real processes: one live job per run directory, ranks that do not outlive their
supervisor, ``ftkit stop``, refusals that write nothing, resume fidelity, and a full disk.

2 CPU ranks, the tiny fixtures model, the real ``ftkit launch`` CLI; every test ends by checking by pid (and in
/dev/shm) that nothing of the run is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.cluster.procs import is_alive
from ftkit.errors import ExitCode
from ftkit.rundir.env import PACE_ENV
from ftkit.rundir.layout import RunDir
from tests.helpers.runs import (  # fx and baseline: conftest.py fixtures
    RUN_ENV,
    RUN_STEPS,
    assert_no_process_left,
    assert_same_losses,
    committed_ok,
    events,
    finish,
    free_port,
    ftkit,
    launched,
    losses,
    mp_lock,
    named,
    output,
    processes_left,
    recipe_and_run,
    wait_for,
    wait_step,
)

pytestmark = pytest.mark.slow
LONG = 120  # steps of a run that must still be training a few seconds after a step-5 event (~0.15 s per step)
# Orphans a later launch must find still training sleep this long after each step: 115 steps then last ~45 s or more,
# against the ~6 s (5 s of the test's own wait) before the relaunch claims the run.
ORPHAN_PACE_S = "0.25"


def assert_same_as_lone_run(run: Path, baseline: dict) -> None:
    """Steps 1-12 equal the lone 12-step run (constant learning rate, same data order), and every step an
    attempt computed again equals what the earlier attempt logged: nothing was lost or trained twice differently."""
    rows = [json.loads(x) for x in RunDir(run).metrics.read_text().splitlines()]
    by_step: dict[int, set[float]] = {}
    for m in rows:
        if "loss" in m:
            by_step.setdefault(int(m["step"]), set()).add(round(float(m["loss"]), 6))
    assert sorted(by_step) == list(range(1, max(by_step) + 1)), "steps missing"
    assert all(len(v) == 1 for v in by_step.values()), {s: v for s, v in by_step.items() if len(v) > 1}
    got = losses(run)
    assert all(abs(got[s] - baseline["losses"][s]) <= 1e-6 for s in range(1, RUN_STEPS + 1))


def error_lines(r: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in r.stderr, r.stderr
    return [line for line in r.stderr.splitlines() if line.startswith("ftkit: error:")]


# ------------------------------------------------------------------------------------------------- one live job


@pytest.mark.timeout(600)
def test_second_launch_into_a_live_run_is_refused_at_once(fx, baseline, tmp_path):
    recipe, run = recipe_and_run(tmp_path, fx)
    with launched(recipe, run) as first:
        wait_for(lambda: (run / "ftkit" / "owner.json").exists(), 60, "the owner record")
        t0 = time.monotonic()
        second = ftkit(
            "launch",
            str(recipe),
            f"cluster.master_port={free_port()}",
            "train.learning_rate=0.0001",
            "train.seed=7",
            env=RUN_ENV,
            timeout=60,
        )
        took = time.monotonic() - t0
        assert second.returncode == ExitCode.RUN_BUSY, second.stdout + second.stderr
        (line,) = error_lines(second)
        assert "a live job owns this run directory" in line and f"pid {first.pid}" in line, line
        assert f"ftkit stop {run}" in line, line
        assert took < 2.0, f"the refusal took {took:.2f}s"
        code = finish(first)
        assert code == ExitCode.OK, output(recipe)[-3000:]
    used = json.loads((run / "ftkit" / "recipe.json").read_text())
    assert used["train"]["learning_rate"] == 1e-3 and used["train"]["seed"] == 7
    assert [e["attempt"] for e in named(run, "launch")] == [0]  # the second never started an attempt
    assert_same_losses(run, baseline["losses"])
    assert not (run / "ftkit" / "owner.json").exists()  # released at the end
    assert_no_process_left(run)


@pytest.mark.timeout(600)
def test_sigkilled_supervisor_ranks_stop_by_themselves_and_relaunch_finishes(fx, baseline, tmp_path):
    orphan_timeout = 2
    # A step takes ~0.15 s here: 120 steps outlast the orphans' timeout by far.
    recipe, run = recipe_and_run(tmp_path, fx, resilience__orphan_timeout_s=orphan_timeout, train__max_steps=LONG)
    with launched(recipe, run, alone=True) as proc:  # a bound in seconds: the machine to itself
        wait_step(run, 0, 5)
        assert processes_left(run)
        proc.kill()  # kill -9 of ftkit launch only: the ranks run in their own session
        killed = time.monotonic()
        proc.wait(10)
        wait_for(
            lambda: not processes_left(run), orphan_timeout + 30, "the orphaned ranks to stop by themselves", poll=0.2
        )
        stopped_s = time.monotonic() - killed
        # The documented bound: orphan_timeout_s + the watchdog's 2 s poll, plus the engine agent's own teardown.
        assert stopped_s <= orphan_timeout + 2 + 8, f"ranks stopped {stopped_s:.1f}s after the supervisor died"
        assert_no_process_left(run)  # /dev/shm included: each rank removed the run's buffers
        logs = "".join(p.read_text(errors="replace") for p in RunDir(run).log_dir(0).glob("rank-*.log"))
        assert "this rank stops itself" in logs
    # ... after saving the step in flight (the graceful stop, asked for by every rank's own watchdog)
    from ftkit.run.status import read_jsonl

    saved = [m["step"] for m in read_jsonl(run / "metrics.jsonl") if m.get("event") == "commit" and m.get("stop")]
    assert len(saved) == 1 and saved[0] >= 5, saved
    # the relaunch resumes from that save and ends a few steps on (a step limit is a change a resume allows)
    with launched(recipe, run, f"train.max_steps={max(RUN_STEPS, saved[0] + 2)}") as proc:
        code = finish(proc)
        assert code == ExitCode.OK, output(recipe)[-3000:]
    chosen = [e for e in events(run) if e["event"] == "checkpoint_chosen"]
    assert chosen and chosen[-1]["step"] == saved[0], chosen
    assert_same_as_lone_run(run, baseline)
    assert_no_process_left(run)
    # the report reads two launches (issue 36, item 10: one, and a breakdown of more than the wall time)
    from ftkit.report import goodput

    g = goodput(events(run), read_jsonl(run / "metrics.jsonl"))
    assert g.launches == 2 and not g.live, g
    assert sum(g.breakdown.values()) == pytest.approx(g.wall_s), g.breakdown


@pytest.mark.timeout(600)
def test_a_relaunch_waits_for_orphans_that_stop_themselves_and_orphans_that_finish_clean_up(fx, baseline, tmp_path):
    """kill -9 of ftkit launch, a relaunch 5 s later (default orphan_timeout_s: 60) used to refuse with exit 11; it
    waits for the ranks to save and stop, then resumes from their save. Orphans that finish the run used to leak
    their /dev/shm buffers and leave no outcome, and their DeepSpeed runner, lingering for seconds, made the next
    launch exit 11 too."""
    recipe, run = recipe_and_run(tmp_path, fx, train__max_steps=LONG)
    with mp_lock():  # one place for all of it: the orphans train on between the launches
        with launched(recipe, run, env={PACE_ENV: ORPHAN_PACE_S}, lock=False) as proc:
            wait_step(run, 0, 5)
            proc.kill()
            proc.wait(10)
        time.sleep(5)
        with launched(recipe, run, lock=False) as proc:
            wait_step(run, 0, LONG - 30, attempt=1, timeout=240)
            out = output(recipe)
            assert "its ranks still run" in out and "waiting for them" in out, out[-3000:]
            proc.kill()  # again, near the end: the orphans now finish the run before their watchdog fires
            proc.wait(10)
        wait_for(lambda: not processes_left(run), 90, "the orphans to finish the run", poll=0.2)
        assert_no_process_left(run)  # their /dev/shm buffers included
        assert (run / "final" / "ftkit_commit.json").is_file()
        assert [e["event"] for e in events(run) if e["event"].startswith("orphan_")] == [
            "orphan_stopped",
            "orphan_finished",
        ]
        status = ftkit("status", str(run), env=RUN_ENV, timeout=60)
        assert "outcome: the ranks ended without their supervisor" in status.stdout, status.stdout
        with launched(recipe, run, lock=False) as proc:
            assert finish(proc) == ExitCode.OK, output(recipe)[-3000:]
    assert "the run is already finished" in output(recipe)
    saved = [e for e in events(run) if e["event"] == "checkpoint_chosen" and e["attempt"] == 1]
    assert saved and saved[0]["step"] >= 5, saved  # resumed from the orphans' own save
    assert_same_as_lone_run(run, baseline)
    assert_no_process_left(run)


@pytest.mark.timeout(600)
def test_takeover_of_a_dead_supervisors_ranks_and_stop_force(fx, baseline, tmp_path):
    # Orphans that would train on for 10 minutes and do not stop themselves (pid records without a watchdog, as
    # an older ftkit or a rank started by hand leaves them): a relaunch must refuse, --takeover must stop them first.
    recipe, run = recipe_and_run(tmp_path, fx, resilience__orphan_timeout_s=600, train__max_steps=LONG)
    with mp_lock():  # one place for all of it: the orphans train on between the launches
        with launched(recipe, run, env={PACE_ENV: ORPHAN_PACE_S}, lock=False) as proc:
            wait_step(run, 0, 3)
            proc.kill()
            proc.wait(10)
            for p in (run / "ftkit" / "attempts" / "0" / "pids").glob("rank-*.json"):
                p.write_text(json.dumps({k: v for k, v in json.loads(p.read_text()).items() if k != "watchdog"}))
            refused = ftkit("launch", str(recipe), env=RUN_ENV, timeout=60)
            assert refused.returncode == ExitCode.RUN_BUSY, refused.stdout + refused.stderr
            (line,) = error_lines(refused)
            assert "ranks of its last attempt still run" in line and "--takeover" in line, line
            stop = ftkit("stop", str(run), env=RUN_ENV, timeout=60)
            assert stop.returncode == ExitCode.RUN_BUSY and "--force" in stop.stdout, stop.stdout + stop.stderr
            status = ftkit("status", str(run), env=RUN_ENV, timeout=60)
            assert "now: NOT SUPERVISED" in status.stdout, status.stdout
            assert processes_left(run), "the orphans were expected to still run"
        with launched(recipe, run, "--takeover", lock=False) as proc:
            code = finish(proc)
            assert code == ExitCode.OK, output(recipe)[-3000:]
    assert "stopped" in output(recipe) and named(run, "takeover")
    assert_same_as_lone_run(run, baseline)
    assert_no_process_left(run)

    # ftkit stop --force: the same situation, ended from another shell instead of a relaunch.
    (tmp_path / "b").mkdir()
    recipe2, run2 = recipe_and_run(tmp_path / "b", fx, resilience__orphan_timeout_s=600, train__max_steps=LONG)
    with launched(recipe2, run2) as proc:
        wait_step(run2, 0, 2)
        proc.kill()
        proc.wait(10)
        forced = ftkit("stop", "--force", str(run2), env=RUN_ENV, timeout=120)
        assert forced.returncode == 0, forced.stdout + forced.stderr
        assert not processes_left(run2)
        assert_no_process_left(run2)


@pytest.mark.timeout(600)
def test_ftkit_stop_ends_a_live_run_from_another_shell(fx, tmp_path):
    recipe, run = recipe_and_run(tmp_path, fx, train__max_steps=LONG)
    with launched(recipe, run) as proc:
        wait_step(run, 0, 2)
        stop = ftkit("stop", str(run), env=RUN_ENV, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert proc.wait(10) == ExitCode.STOPPED  # a graceful stop: the step in flight is saved first
        assert named(run, "stopped") and named(run, "stop_requested")
        assert_no_process_left(run)
    again = ftkit("stop", str(run), env=RUN_ENV, timeout=60)
    assert again.returncode == 0 and "nothing of the run" in again.stdout, again.stdout + again.stderr


# ------------------------------------------------------------------------------------------------- resuming


@pytest.mark.timeout(600)
def test_refused_relaunches_write_nothing(fx, baseline, tmp_path):
    recipe, run = recipe_and_run(tmp_path, fx)
    shutil.copytree(baseline["run"], run, symlinks=True)
    before = {p: p.stat().st_mtime_ns for p in (run / "ftkit").rglob("*") if p.is_file()}
    with mp_lock():
        r = ftkit("launch", str(recipe), "train.max_steps=10", env=RUN_ENV, timeout=120)
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    assert "checkpoint-12 is past train.max_steps=10" in r.stdout, r.stdout
    after = {p: p.stat().st_mtime_ns for p in (run / "ftkit").rglob("*") if p.is_file() and p.name != "lock"}
    assert {p: t for p, t in before.items() if p.name != "lock"} == after  # spec and configs untouched
    # A refused ZeRO stage change, likewise: decided before spec.json and ds_config.json are written.
    with mp_lock():
        r = ftkit("launch", str(recipe), "zero.stage=3", env=RUN_ENV, timeout=120)
    assert r.returncode == ExitCode.NO_CHECKPOINT, r.stdout + r.stderr
    assert "committed with ZeRO stage 2, this launch uses stage 3" in r.stdout, r.stdout
    again = {p: p.stat().st_mtime_ns for p in (run / "ftkit").rglob("*") if p.is_file() and p.name != "lock"}
    assert again == after
    assert json.loads((run / "ftkit" / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2


@pytest.mark.timeout(600)
def test_recomputed_steps_that_disagree_with_the_logged_run_stop_it(fx, baseline, tmp_path):
    recipe, run = recipe_and_run(tmp_path, fx, resilience__max_restarts=0, resilience__resume_tolerance=0.0)
    with launched(recipe, run, env={"FTKIT_FAULT_INJECT": "exit:1:7"}) as proc:
        assert finish(proc) == ExitCode.BUDGET_EXHAUSTED, output(recipe)[-3000:]
    # Steps 5-7 were logged by attempt 0; the relaunch resumes from checkpoint-4 and computes them again. Make the
    # logged step 6 disagree, as a resume from the wrong state would (the loss-jump-after-resume reports).
    metrics = RunDir(run).metrics
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    for m in rows:
        if m.get("step") == 6 and "loss" in m:
            m["loss"] *= 1.5
    metrics.write_text("".join(json.dumps(m) + "\n" for m in rows))
    with launched(recipe, run) as proc:
        code = finish(proc)
    assert code == ExitCode.RESUME_MISMATCH, output(recipe)[-3000:]
    mism = [e for e in named(run, "resume_mismatch") if e["attempt"] == 1]
    assert [(e["step"], e["metric"], e["stop"]) for e in mism] == [(6, "loss", True)], mism
    assert "resumed state disagrees" in output(recipe)
    assert [e["step"] for e in named(run, "resume_mismatch")] == [6]  # step 5 matched bit for bit
    assert_no_process_left(run)


@pytest.mark.timeout(600)
def test_full_disk_ends_with_one_line_and_keeps_the_committed_checkpoint(fx, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    # A checkpoint of the tiny model is ~2.7 MB: checkpoint-4 fits, checkpoint-8 does not.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        recipe, _ = recipe_and_run(tmp_path, fx, train__output_dir=str(disk / "run"), resilience__max_restarts=3)
        run = disk / "run"
        with launched(recipe, run) as proc:
            code = finish(proc)
        out = output(recipe)
        assert code == ExitCode.NO_SPACE, out[-3000:]
        assert "Traceback" not in out
        assert f"no space left on {run}" in out or "no space left on" in out, out[-2000:]
        assert not named(run, "restart"), "a full disk must not be restarted"
        assert committed_ok(run / "checkpoint-4")
        assert not [p for p in run.glob("checkpoint-*") if p.name != "checkpoint-4"], list(run.iterdir())
        temps = [p for p in run.rglob("*") if p.name.startswith(".")]  # atomic writes' and deletions' temp names
        assert not temps, temps
        gave_up = named(run, "gave_up")
        assert gave_up and gave_up[-1]["exit_code"] == ExitCode.NO_SPACE, gave_up
        assert_no_process_left(run)
        # A relaunch onto the still-full disk: less free space than checkpoint-4 took. It used to warn "0.0G free"
        # and start anyway, only to fill the disk again; now it refuses before anything starts (and so does
        # --dry-run).
        spawns = len(named(run, "spawn"))
        for args in (["--dry-run"], []):
            r = ftkit("launch", str(recipe), *args, env=RUN_ENV, timeout=120)
            assert r.returncode == ExitCode.NO_SPACE, (args, r.stdout[-2000:], r.stderr[-2000:])
            assert "Traceback" not in r.stderr and "checkpoint-4 took" in r.stdout + r.stderr, r.stdout + r.stderr
        assert len(named(run, "spawn")) == spawns
    finally:
        subprocess.run(["umount", "-l", str(disk)])


# ------------------------------------------------------------------------------------------------- SIGTERM in preflight


@pytest.mark.timeout(120)
def test_sigterm_during_preflight_leaves_no_ssh_probe_behind(fx, tmp_path):
    """A remote host whose ssh hangs: SIGTERM to ftkit launch ends it at once (143), and the probe dies with it."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    pidfile = tmp_path / "ssh.pid"
    (bindir / "ssh").write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 120\n")
    (bindir / "ssh").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker1 slots=1\nworker2 slots=1\n")
    recipe, run = recipe_and_run(tmp_path, fx, cluster__gpus_per_node=1, cluster__master_addr="127.0.0.1")
    env = {**os.environ, **RUN_ENV, "PATH": f"{bindir}:{os.environ['PATH']}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftkit", "launch", str(recipe), "--hostfile", str(hostfile)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(pidfile.exists, 60, "the ssh probe to start")
        probe = int(pidfile.read_text())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == ExitCode.SIGTERM, out + err
        assert "Traceback" not in err and "interrupted by SIGTERM" in err, err
        wait_for(lambda: not is_alive(probe), 5, "the ssh probe to be gone")
        assert not (run / "ftkit" / "owner.json").exists()
        assert not (run / "ftkit" / "spec.json").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if pidfile.exists() and is_alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert not events(run)
