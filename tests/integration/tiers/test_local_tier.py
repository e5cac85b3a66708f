"""Issue 24 with real processes: the local checkpoint tier, its background copies and resume across tiers.

Two CPU ranks, the tiny model, the real ``ftkit launch``. A storm of random SIGKILLs must cost at most about one
step each (every resume from the local tier), a killed copy must never leave a durable checkpoint that is not
complete, and nothing of the run may be left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from ftkit.checkpoint.directory import list_checkpoints
from ftkit.checkpoint.layout import COMMIT_FILE
from ftkit.checkpoint.verify import verify
from ftkit.errors import ExitCode
from ftkit.rundir.layout import RunDir, read_jsonl
from tests.helpers.runs import (
    RUN_ENV,
    RUN_TIMEOUT_S,
    assert_no_process_left,
    ftkit,
    heartbeat_step,
    kill_tree,
    local_tier_root,
    losses,
    mp_lock,
    named,
    rank_pid,
    start_ftkit,
    wait_for,
)
from tests.helpers.runs import write_recipe as _write_recipe

pytestmark = pytest.mark.slow

LORA = {"peft__r": 8, "peft__target_modules": ["q_proj", "v_proj"], "train__learning_rate": 1e-2}
# 10 took 505 s of a CI run (an attempt starts in 35-45 s there), 6 took 259 s, 4 took 121 s; CI's 3 land mid-step,
# mid-save and mid-copy over a few runs (the moment is random, the seed printed); FTKIT_STORM_KILLS=10 for a longer one
KILLS = int(os.environ.get("FTKIT_STORM_KILLS") or 3)
STORM_STEPS = 30


def tier_recipe(d: Path, fx: dict[str, Path], **overrides: object) -> Path:
    return _write_recipe(d, fx, checkpoint__local_dir="auto", checkpoint__local_steps=1, **overrides)


def logged(run: Path) -> list[dict]:
    return [m for m in read_jsonl(RunDir(run).metrics) if "loss" in m]


def test_a_storm_of_sigkills_costs_at_most_a_step_each_and_every_resume_is_local(
    fx: dict[str, Path], tmp_path: Path
) -> None:
    """LoRA, a local save every step, durable every 10: KILLS (3 in CI) SIGKILLs of a random rank at random moments
    (mid-step, mid-save, mid-copy) -> exit 0, the losses of an uninterrupted run, every resume from the local tier,
    on average at most one step recomputed per kill."""
    overrides = dict(LORA, train__max_steps=STORM_STEPS, train__save_steps=10, resilience__max_restarts=KILLS + 2)
    ref_dir, storm_dir = tmp_path / "ref", tmp_path / "storm"
    ref_dir.mkdir(), storm_dir.mkdir()
    with mp_lock():
        r = ftkit("launch", str(tier_recipe(ref_dir, fx, **overrides)), env=RUN_ENV, timeout=RUN_TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reference = losses(ref_dir / "run")
    assert sorted(reference) == list(range(1, STORM_STEPS + 1))

    seed = int(os.environ.get("FTKIT_STORM_SEED") or time.time())
    rng = random.Random(seed)
    run = storm_dir / "run"
    recipe = tier_recipe(storm_dir, fx, **overrides)
    with mp_lock():
        proc = start_ftkit("launch", str(recipe), env=RUN_ENV, log=storm_dir / "launch.log")
        try:
            started: list[int] = []  # the step each attempt began at (the step it resumed from)
            for attempt in range(KILLS):
                what = f"attempt {attempt} trains (seed {seed})"
                wait_for(lambda a=attempt: heartbeat_step(run, 0, a) >= 0, 180, what)
                started.append(heartbeat_step(run, 0, attempt))
                # A kill one step after the start may land before that step's commit. Before the first commit that
                # is a fresh start (nothing to resume: not the local resume this test is about); after a resume the
                # next attempt resumes from the same step, and three failures at one point with no new commit is
                # the supervisor's crash loop (it gives up, by design). So the first kill, and the one after such a
                # repeat, wait for a new commit: the heartbeat of step s+2 comes after step s+1's save.
                repeat = len(started) > 1 and started[-1] == started[-2]
                target = started[-1] + (2 if repeat or started[-1] <= 0 else rng.randint(1, 2))
                wait_for(lambda a=attempt, t=target: heartbeat_step(run, 0, a) >= t, 120, f"step {target}", poll=0.02)
                time.sleep(rng.uniform(0, 0.25))  # anywhere in the next step: its forward, its save, a copy
                rank = rng.randrange(2)
                pid = rank_pid(run, rank, attempt)
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            kill_tree(proc)
    log = (storm_dir / "launch.log").read_text()
    assert proc.returncode == 0, f"seed {seed}:\n{log[-4000:]}"

    got = losses(run)
    assert got == reference, f"seed {seed}: the losses differ from the uninterrupted run"
    launches = named(run, "launch")
    assert len(launches) == KILLS + 1
    tiers = [e.get("tier") for e in launches[1:]]
    assert tiers == ["local"] * KILLS, f"seed {seed}: resumed from {tiers}"

    # steps recomputed per kill: the newest step the killed attempt logged, less the step the next one resumed from
    rows = logged(run)
    recomputed = []
    for e in launches[1:]:
        before = [m["step"] for m in rows if m["attempt"] == e["attempt"] - 1]
        recomputed.append(max(0, max(before, default=0) - int(e["step"])))
    assert sum(recomputed) / KILLS <= 1.0, f"seed {seed}: recomputed {recomputed}"
    print(f"seed {seed}: steps recomputed per kill {recomputed} (mean {sum(recomputed) / KILLS:.2f})")

    # durable copies went on in the background; what the run directory holds is complete
    for _, path in list_checkpoints(run):
        assert verify(path, True, require_commit=True).ok, path
    assert (run / "final" / COMMIT_FILE).is_file()
    assert_no_process_left(run)


def test_killing_the_copying_agent_and_then_the_attempt_never_leaves_a_partial_durable_checkpoint(
    fx: dict[str, Path], tmp_path: Path
) -> None:
    """The agent copies slowly (a test-only pause after each file): SIGKILL it mid-copy (the rank restarts it at
    its next save), then SIGKILL the whole attempt mid-copy. No checkpoint-N without a verified commit is ever in
    the run directory, and the resume takes the local tier, never a partial copy."""
    run = tmp_path / "run"
    recipe = tier_recipe(
        tmp_path,
        fx,
        train__max_steps=62,  # not a multiple of save_steps: the last step is made durable at the end all the same
        train__save_steps=4,
        resilience__max_restarts=3,
        resilience__hang_timeout_s=60,
    )
    env = {**RUN_ENV, "FTKIT_AGENT_PAUSE_S": "0.4"}
    staging = lambda: sorted(run.glob(".staging-checkpoint-*[0-9]"))  # noqa: E731
    seen_partial: list[str] = []

    def partial_durable() -> None:
        for _, path in list_checkpoints(run):
            if not (path / COMMIT_FILE).is_file():
                seen_partial.append(path.name)

    def copying() -> list[Path]:
        partial_durable()
        return [p for p in staging() if any(p.rglob("*.pt")) or any(p.rglob("*.safetensors"))]

    with mp_lock():
        proc = start_ftkit("launch", str(recipe), env=env, log=tmp_path / "launch.log")
        try:
            wait_for(copying, 180, "a background copy in progress", poll=0.02)
            agents = RunDir(run).records("agents", 0)
            assert agents, "no agent record"
            os.kill(int(agents[0]["pid"]), signal.SIGKILL)
            # the rank restarts its agent at its next save; then the whole attempt is killed in the middle of a copy
            wait_for(lambda: _agent_restarted(run), 180, "the agent restarted")
            wait_for(copying, 180, "another background copy", poll=0.02)
            for rank in (0, 1):
                pid = rank_pid(run, rank, 0)
                if pid:
                    os.kill(pid, signal.SIGKILL)
            while proc.poll() is None:
                partial_durable()
                time.sleep(0.05)
        finally:
            kill_tree(proc)
    log = (tmp_path / "launch.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert not seen_partial, f"uncommitted durable checkpoints appeared: {seen_partial}"
    launch = named(run, "launch")[1]
    assert launch["tier"] == "local", launch
    for _, path in list_checkpoints(run):
        assert verify(path, True, require_commit=True).ok
    assert not list(run.glob(".staging-*")), "a staging directory was left"
    assert losses(run).keys() == set(range(1, 63))
    assert verify(run / "checkpoint-62", True, require_commit=True).ok, "the finished run's last step is not durable"
    assert_no_process_left(run)


def _agent_restarted(run: Path) -> bool:
    log = run / "logs" / "attempt-0" / "rank-0.log"
    return log.is_file() and "): restarted" in log.read_text(errors="replace")


def test_a_graceful_stop_saves_to_the_local_tier_waits_for_the_durable_copy_and_leaves_nothing_in_dev_shm(
    fx: dict[str, Path], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    recipe = tier_recipe(tmp_path, fx, train__max_steps=200, train__save_steps=50)
    with mp_lock():
        proc = start_ftkit("launch", str(recipe), env=RUN_ENV, log=tmp_path / "launch.log")
        try:
            wait_for(lambda: heartbeat_step(run, 0, 0) >= 3, 180, "step 3")
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            kill_tree(proc)
    assert proc.returncode == ExitCode.STOPPED, (tmp_path / "launch.log").read_text()[-3000:]
    stopped = [m for m in read_jsonl(RunDir(run).metrics) if m.get("event") == "commit" and m.get("stop")]
    assert len(stopped) == 1 and stopped[0]["tier"] == "local"
    step = stopped[0]["step"]
    assert step % 50, "the stop's step is not one of train.save_steps' own"
    v = verify(run / f"checkpoint-{step}", True, require_commit=True)
    assert v.ok, v.reason
    assert "is durable in the run directory" in (run / "logs" / "attempt-0" / "rank-0.log").read_text()
    assert_no_process_left(run)
    root = local_tier_root(run)
    assert root is not None and not root.exists()


def _planned_tier(recipe: Path) -> str:
    from ftkit.plan.plan import build_plan
    from ftkit.recipe.load import load_recipe

    plan = build_plan(load_recipe(str(recipe)))
    assert plan.local_tier is not None, plan.local_tier_off
    return plan.local_tier.dir


def test_a_launch_into_a_tier_another_user_made_first_starts_nothing(fx: dict[str, Path], tmp_path: Path) -> None:
    """Issue 36, item 1, with a real `ftkit launch`: another local user made the run's predictable
    /dev/shm/ftkit-<name>-<hash> first (0777, theirs). The launch refuses before any rank starts (exit 3, one line
    naming the path and its owner) and writes nothing there; the old one saved the full weights into it."""
    from tests.helpers.users import other_user

    recipe = tier_recipe(tmp_path, fx, train__max_steps=4)
    template = _planned_tier(recipe)
    root = Path(template).parent
    assert "{host}" in template and root.parent == Path("/dev/shm"), template
    try:
        with other_user() as mallory, mp_lock():
            mallory.run("mkdir", "-m", "0777", str(root), check=True)  # (made here: the wait for the lock is long)
            r = ftkit("launch", str(recipe), env=RUN_ENV, timeout=RUN_TIMEOUT_S)
            assert r.returncode == ExitCode.PREFLIGHT, r.stdout[-3000:] + r.stderr[-3000:]
            errors = [line for line in r.stderr.splitlines() if line.startswith("ftkit: error:")]
            assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
            assert f"{root}: owned by uid {mallory.uid}, not by this user" in errors[0], errors
            assert os.listdir(root) == [] and root.stat().st_uid == mallory.uid  # nothing written, nothing removed
            assert not RunDir(tmp_path / "run").log_dir(0).exists(), "a rank started"
            assert named(tmp_path / "run", "refused")[-1]["kind"] == "tier_unsafe"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_relaunch_of_a_finished_run_removes_the_tier_its_orphans_left_and_status_tells(
    fx: dict[str, Path], baseline: dict, tmp_path: Path
) -> None:
    """Issue 36, item 13: an orphan-finished run (supervisor SIGKILLed, ranks finish) left its tier in /dev/shm;
    a relaunch ("already finished") left it too, and `ftkit status` never mentioned it. Here the finished run is
    the baseline's, with a tier left as the orphans left it; the relaunch copies what is due from it and removes it."""
    from ftkit.checkpoint.tiers import open_tier

    run = tmp_path / "run"
    shutil.copytree(baseline["run"], run, symlinks=True)
    recipe = tier_recipe(tmp_path, fx)
    template = _planned_tier(recipe)
    spec = json.loads((run / "ftkit" / "spec.json").read_text())
    spec["local_tier"] = {"dir": template, "steps": 1, "keep": 2, "peer_copies": 0, "durable_steps": 4}
    spec["local_tier"] |= {"bytes_per_node": 0, "host_gb_per_node": 0.0, "why": "the orphans' tier"}
    spec["local_tier"] |= {"nodes": ["localhost"], "ssh_config": None}  # every key a spec has (RunSpec.from_dict)
    (run / "ftkit" / "spec.json").write_text(json.dumps(spec))
    node = open_tier(template, "localhost")
    assert node is not None
    shutil.copytree(run / "checkpoint-12", node / "checkpoint-11")  # what the orphans' tier held (any bytes)
    try:
        status = ftkit("status", str(run), env=RUN_ENV, timeout=60)
        assert f"local tier left behind: {node}: 1 checkpoint(s)" in status.stdout, status.stdout
        with mp_lock():
            r = ftkit("launch", str(recipe), env=RUN_ENV, timeout=RUN_TIMEOUT_S)
        assert r.returncode == 0 and "the run is already finished" in r.stdout, r.stdout[-3000:] + r.stderr
        assert not Path(template).parent.exists(), "the finished run's tier is still in /dev/shm"
        assert "local tier" not in ftkit("status", str(run), env=RUN_ENV, timeout=60).stdout
    finally:
        shutil.rmtree(Path(template).parent, ignore_errors=True)
