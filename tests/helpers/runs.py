"""Helpers for tests that run real multi-process jobs: fixtures on disk, recipes, launching, killing, checking.

Multi-process tests take a place under ``/tmp/ftkit-mp.lock`` (see ``mp_lock``): by default one run at a time, so two
suites never share the 2 cores; ``FTKIT_TEST_RUNS=2`` (the integration tier of ``make test``) lets two runs overlap. The
session's shared runs (the ``fx`` and ``baseline`` fixtures) are in tests/integration/conftest.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ftkit.checkpoint.verify import verify
from ftkit.cluster.procs import is_alive
from ftkit.rundir.layout import RunDir
from tests.helpers.paths import SCRIPTS

LOCK = "/tmp/ftkit-mp.lock"

# The real 2-rank runs' environment, length and time bound (those of the session's baseline run, too).
RUN_ENV = {"DS_ACCELERATOR": "cpu"}
RUN_STEPS = 12  # write_recipe's default: checkpoints every 4 steps, the newest 2 kept
RUN_TIMEOUT_S = 240  # an upper bound for one whole `ftkit launch` with a restart or two (a clean run takes ~15 s)


def run_slots() -> int:
    """How many multi-process runs may share the machine (``FTKIT_TEST_RUNS``, default 1: one at a time)."""
    try:
        return max(1, int(os.environ.get("FTKIT_TEST_RUNS", "1")))
    except ValueError:
        return 1


@contextlib.contextmanager
def mp_lock(*, alone: bool = False) -> Iterator[None]:
    """Hold one of ``run_slots()`` places for a multi-process run; ``alone``: the machine to itself (a test whose
    assertions are about time: step times, stragglers, the stop of an orphan within seconds).

    A readers-writer gate (``LOCK``: shared for a place, exclusive for ``alone``) and one file per place.
    ``FTKIT_TEST_LOCK_HELD=1``: the caller already holds the gate exclusively for the whole session (``flock
    /tmp/ftkit-mp.lock env FTKIT_TEST_LOCK_HELD=1 pytest ...``: a namespace suite that must run alone), so taking it
    again here would wait on itself.
    """
    if os.environ.get("FTKIT_TEST_LOCK_HELD") == "1":
        yield
        return
    with open(LOCK, "w") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            if alone:
                yield
                return
            while True:
                for i in range(run_slots()):
                    slot = open(f"{LOCK}.{i}", "w")  # noqa: SIM115 (held for the run, closed below)
                    try:
                        fcntl.flock(slot, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        slot.close()
                        continue
                    try:
                        yield
                        return
                    finally:
                        slot.close()
                time.sleep(0.2)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)


def make_fixtures(root: Path, kind: str = "text") -> dict[str, Path]:
    """Tiny model, tokenizer and learnable data under root (built in a subprocess: no torch in the test process)."""
    out = subprocess.run(
        [sys.executable, "-m", "ftkit.launch.fixtures", str(root), "--kind", kind, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith("{"))  # libraries may print first
    return {k: Path(v) for k, v in json.loads(line).items()}


def script_command(name: str, fixtures: dict[str, Path], *extra: str) -> list[str]:
    """``python tests/scripts/NAME --model M --data D EXTRA...``: an unmodified user script on the fixtures."""
    return ["python", str(SCRIPTS / name), "--model", str(fixtures["model"]), "--data", str(fixtures["data"]), *extra]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_recipe(directory: Path, fixtures: dict[str, Path], **overrides: Any) -> Path:
    """A 2-rank CPU recipe (the cpu-demo template's values) with ``section__key=value`` overrides."""
    values: dict[str, dict[str, Any]] = {
        "model": {"path": str(fixtures["model"])},
        "data": {"train": str(fixtures["data"]), "max_seq_len": 128},
        "train": {
            "output_dir": str(directory / "run"),
            "precision": "fp32",
            "micro_batch_size": 4,
            "global_batch_size": 16,
            "max_steps": 12,
            "learning_rate": 1e-3,
            "lr_scheduler": "constant",
            "logging_steps": 1,
            "save_steps": 4,
            "save_total_limit": 2,
            "seed": 7,
        },
        "zero": {"stage": 2},
        # every save to the run directory, as the tests of checkpoints there expect; tests/integration/tiers/ turn the
        # local tier on (the recipe's default is auto)
        "checkpoint": {"local_dir": None},
        "cluster": {
            "gpus_per_node": 2,
            "accelerator": "cpu",
            "gpu_memory_gb": 8,
            "host_memory_gb": 16,
            "master_port": free_port(),
        },
        "resilience": {
            "max_restarts": 3,
            "hang_timeout_s": 30,
            "startup_timeout_s": 240,
            "backoff_s": 0.5,
            "backoff_max_s": 2,
        },
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if value is None and not name:
            values.pop(section, None)
            continue
        values.setdefault(section, {})[name] = value
    import yaml

    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def ftkit(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    e = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ftkit", *args], capture_output=True, text=True, env=e, timeout=timeout, cwd=cwd
    )


def start_ftkit(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start ``ftkit ...`` in the background (its own session, so a test can signal it like a terminal would)."""
    e = {**os.environ, **(env or {})}
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "ftkit", *args], stdout=out, stderr=subprocess.STDOUT, env=e, start_new_session=True
    )


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    poll: float = 0.1,
    while_running: subprocess.Popen[Any] | None = None,
) -> Any:
    """``predicate()``'s first true value; ``while_running``: fail at once when that process ended first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if while_running is not None and while_running.poll() is not None:
            raise AssertionError(f"the process ended (exit {while_running.returncode}) before {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def heartbeat_step(run_dir: Path, rank: int, attempt: int = 0) -> int:
    for hb in RunDir(run_dir).heartbeats():
        if hb.get("rank") == rank and hb.get("attempt") == attempt and hb.get("step") is not None:
            return int(hb["step"])
    return -1


def rank_pid(run_dir: Path, rank: int, attempt: int = 0) -> int | None:
    for rec in RunDir(run_dir).records("pids", attempt):
        if rec["rank"] == rank:
            return int(rec["pid"])
    return None


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step training loss; where a step was recomputed after a restart, the later attempt's value."""
    out: dict[int, float] = {}
    path = RunDir(run_dir).metrics
    for line in path.read_text().splitlines():
        m = json.loads(line)
        if "loss" in m:
            out[int(m["step"])] = float(m["loss"])
    return out


def events(run_dir: Path) -> list[dict[str, Any]]:
    p = RunDir(run_dir).events
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def named(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """The events.jsonl records of one kind (``spawn``, ``restart``, ...), in order."""
    return [e for e in events(run_dir) if e.get("event") == name]


def processes_left(run_dir: Path) -> list[str]:
    """Every rank (and per-node agent) any attempt recorded, and every launcher group ftkit spawned, still running."""
    rd = RunDir(run_dir)
    left = []
    for attempt_dir in sorted((rd.meta / "attempts").glob("*")):
        for rec in rd.records("pids", int(attempt_dir.name)):
            if is_alive(int(rec["pid"]), rec.get("start_time")):
                left.append(f"rank {rec['rank']} pid {rec['pid']}")
            if rec.get("ppid_start_time") and is_alive(int(rec["ppid"]), rec["ppid_start_time"]):
                left.append(f"agent of rank {rec['rank']} pid {rec['ppid']}")
        for rec in rd.records("agents", int(attempt_dir.name)):  # the local tier's checkpoint agents
            if is_alive(int(rec["pid"]), rec.get("start_time")):
                left.append(f"checkpoint agent on {rec['host']} pid {rec['pid']}")
    for e in events(run_dir):
        if e.get("event") == "spawn":
            try:
                os.killpg(int(e["pid"]), 0)
                left.append(f"launcher group {e['pid']}")
            except ProcessLookupError:
                pass
    return left


def assert_no_process_left(run_dir: Path, extra_pids: tuple[int, ...] = ()) -> None:
    """Every rank (and per-node agent) any attempt recorded, and every spawned launcher, is gone."""
    rd = RunDir(run_dir)
    left = processes_left(run_dir)
    for pid in extra_pids:
        if is_alive(pid):
            left.append(f"pid {pid}")
    assert not left, f"processes left: {left}"
    # ... and no shared memory: DeepSpeed's CPU collectives leave ~70 MB per rank in /dev/shm unless removed.
    import fnmatch

    from ftkit.cluster.procs import SHM_DIR, shm_patterns

    records = [r for a in sorted((rd.meta / "attempts").glob("*")) for r in rd.records("pids", int(a.name))]
    local = shm_patterns([r for r in records if r["host"] == "localhost"]).get("localhost", set())
    names = os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []
    leaked = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in local)]
    assert not leaked, f"shared memory left in {SHM_DIR}: {leaked}"
    tier = local_tier_root(run_dir)
    assert tier is None or not tier.exists(), f"the local checkpoint tier is left: {sorted(tier.rglob('*'))[:5]}"


def log_tails(run_dir: Path, chars: int = 1500) -> str:
    """The end of every rank and engine log of every attempt, for a failure message (a run directory that pytest
    later rotates away keeps its story in the test's output)."""
    parts = []
    for log in sorted((run_dir / "logs").glob("attempt-*/*.log")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        parts.append(f"--- {log.relative_to(run_dir)}\n{text[-chars:]}")
    return "\n".join(parts)


def local_tier_root(run_dir: Path) -> Path | None:
    """The run's local tier directory on this machine (every node's under it), None when the run has none."""
    from ftkit.rundir.spec import RunSpec

    try:
        tier = RunSpec.read(RunDir(run_dir).spec).local_tier
    except (OSError, ValueError):
        return None
    if not tier:
        return None
    template = Path(tier["dir"])
    return template.parent if "{host}" in template.name else template


def kill_tree(proc: subprocess.Popen) -> None:
    """Last-resort cleanup for a test that failed half-way."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------- one run, driven
# (the recovery, graceful-stop, ownership and resume tests: a launch in the background, signalled from outside)


def recipe_and_run(tmp_path: Path, fx: dict[str, Path], **overrides: Any) -> tuple[Path, Path]:
    """``write_recipe`` into tmp_path, and the run directory it names."""
    recipe = write_recipe(tmp_path, fx, **overrides)
    return recipe, tmp_path / "run"


def kill_leftovers(run: Path) -> None:
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
def launched(
    recipe: Path, run: Path, *args: str, env: dict[str, str] | None = None, alone: bool = False, lock: bool = True
) -> Iterator[subprocess.Popen]:
    """``ftkit launch RECIPE ARGS`` in the background, under the multi-process lock (``alone``: see ``mp_lock``);
    cleaned up if the test fails. ``lock=False``: the caller holds a place already, for a test whose processes
    outlive one launch (orphaned ranks a relaunch must find still training: between two ``launched`` blocks another
    worker's run could take the place and the machine for minutes while the orphans, unaccounted, finish)."""
    with mp_lock(alone=alone) if lock else contextlib.nullcontext():
        proc = start_ftkit(
            "launch", str(recipe), *args, env={**RUN_ENV, **(env or {})}, log=recipe.parent / "ftkit.log"
        )
        try:
            yield proc
        except BaseException:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the supervisor's own teardown first
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(40)
            kill_tree(proc)
            kill_leftovers(run)
            raise


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> int:
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
    steps = steps or range(1, RUN_STEPS + 1)
    assert sorted(set(steps) - set(got)) == [], f"steps without a loss: {sorted(set(steps) - set(got))}"
    diffs = {s: (got[s], expected[s]) for s in steps if abs(got[s] - expected[s]) > 1e-6}
    assert not diffs, f"losses differ from the uninterrupted run (step: got, expected): {diffs}"


def committed_ok(ckpt: Path) -> bool:
    v = verify(ckpt, checksums=True, require_commit=True)
    return v.ok and v.committed


def copy_op_builds(dest: Path) -> Path | None:
    """A copy of this machine's DeepSpeed op builds at ``dest`` (without a build lock), for runs whose kills must not
    reach other runs' op loading (set it as TORCH_EXTENSIONS_DIR); None when nothing is built yet."""
    import shutil

    from ftkit.cluster.buildlocks import extension_roots

    built = [r for r in extension_roots() if (r / "deepspeed_shm_comm").is_dir()]
    if not built:
        return None
    if not dest.is_dir():
        shutil.copytree(built[0], dest, symlinks=True, ignore=shutil.ignore_patterns("lock"))
    return dest
