"""``ftkit submit``: a Slurm batch script for a recipe, written into the run directory and handed to ``sbatch``;
and the batch side of that job (``python -m ftkit.run.submit batch ...``, what the script runs).

The script asks for ``--requeue``, ``--open-mode=append`` (one output file across requeues) and
``--signal=B:USR1@T``: Slurm sends SIGUSR1 to the batch process T seconds before the time limit, and at once on a
preemption notice (``preempt_send_user_signal``). The batch process is Python (``exec``, no shell left between
Slurm and ftkit: bash traps miss signals that arrive with SIGCONT), and it runs the launch in-process
(:func:`ftkit.run.job.launch`), so USR1 reaches the supervisor's own handler: every rank saves the step in flight,
teardown, exit 8. Then, when USR1 was among the signals and the requeue budget allows (``SLURM_RESTART_COUNT`` <
``resilience.max_requeues``), it runs ``scontrol requeue $SLURM_JOB_ID``; the job restarts later with the same id
and resumes from the committed checkpoint. Budget spent: exit 8 and the job ends.

T is derived from the run's own history: the slowest ``commit_s`` in metrics.jsonl (a checkpoint save), doubled,
plus 30 s for the step in flight, teardown and the requeue; at most ``resilience.stop_timeout_s`` (the longest a
graceful stop may take), which is also T when nothing was saved yet.

Each batch start and end is a ``{"event": "slurm", "job_id", "restart_count", "reason"}`` line in events.jsonl
(:mod:`ftkit.run.status` shows them).
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from ftkit import __version__
from ftkit.errors import ExitCode, FtkitError, UserError
from ftkit.recipe.load import load_recipe
from ftkit.run.job import LaunchRequest, launch, require_launchable
from ftkit.run.status import read_metrics
from ftkit.rundir.layout import append_jsonl, atomic_write
from ftkit.rundir.records import Event

SCRIPT_NAME = "submit.sbatch"
MAX_REQUEUES = 3  # resilience.max_requeues when the recipe predates it
MARGIN_S = 30  # seconds for the step in flight, teardown and `scontrol requeue`, on top of the save itself


@dataclass(frozen=True)
class SubmitRequest:
    recipe: str
    overrides: tuple[str, ...] = ()
    nodes: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    sbatch_args: tuple[str, ...] = ()
    dry_run: bool = False


def signal_lead_s(run_dir: Path, stop_timeout_s: float) -> int:
    """Seconds before the time limit for Slurm's USR1: 2 x the slowest measured save + MARGIN_S, capped by
    stop_timeout_s (the whole graceful stop is bounded by it); stop_timeout_s when nothing was measured yet."""

    saves = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for m in read_metrics(metrics):
            if m.get("event") == "commit" and isinstance(m.get("commit_s"), (int, float)):
                saves.append(float(m["commit_s"]))
    cap = max(1, math.ceil(stop_timeout_s))
    if not saves:
        return cap
    return min(cap, math.ceil(2 * max(saves) + MARGIN_S))


def batch_script(
    *,
    name: str,
    run_dir: Path,
    recipe: Path,
    overrides: Sequence[str],
    workdir: str,
    python: str,
    nodes: int,
    gpus_per_node: int,
    accelerator: str,
    lead_s: int,
    time_limit: str | None = None,
    partition: str | None = None,
    account: str | None = None,
) -> str:
    """The sbatch script (text). Every value that reaches the shell line is quoted here, once."""
    out = run_dir / "slurm"
    lines = [
        "#!/bin/sh",
        f"# ftkit submit: recipe {recipe}; written by ftkit {_version()}, do not edit (resubmit instead).",
        "# The batch process is Python (exec below): Slurm's USR1 reaches ftkit's own handler -> graceful stop",
        "# (the step in flight saved and committed) -> scontrol requeue within resilience.max_requeues.",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{lead_s}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={out}/job-%j.out",
        f"#SBATCH --chdir={workdir}",
    ]
    if accelerator == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    cmd = [python, "-m", "ftkit.run.submit", "batch", str(recipe), *overrides]
    lines += ["", f"exec {shlex.join(cmd)}", ""]
    return "\n".join(lines)


def _version() -> str:

    return __version__


def _directive_value(what: str, value: str | None) -> None:
    if value is not None and (not value or any(c.isspace() for c in value)):
        raise UserError(f"--{what} {value!r}: one word without spaces")


def submit(req: SubmitRequest, echo: Callable[[str], None] = print, env: Mapping[str, str] | None = None) -> int:
    """Write RUN/slurm/submit.sbatch and run ``sbatch`` on it (``--dry-run``: print it, submit nothing)."""
    import shutil

    env = dict(os.environ if env is None else env)
    overrides = list(req.overrides)
    recipe = load_recipe(req.recipe, overrides)
    require_launchable(recipe)
    if recipe.cluster.engine != "slurm":  # the job's ranks start with srun, whatever the recipe uses elsewhere
        overrides.append("cluster.engine=slurm")
        if recipe.cluster.hostfile is not None:
            overrides.append("cluster.hostfile=null")  # the allocation gives the hosts
        recipe = load_recipe(req.recipe, overrides)
    for what, value in (("time", req.time), ("partition", req.partition), ("account", req.account)):
        _directive_value(what, value)
    nodes = req.nodes if req.nodes is not None else recipe.cluster.num_nodes
    if nodes < 1:
        raise UserError(f"--nodes {nodes}: at least 1")
    run_dir = Path(recipe.train.output_dir).resolve()
    stop_timeout = float(recipe.resilience.stop_timeout_s or 120)
    lead = signal_lead_s(run_dir, stop_timeout)
    text = batch_script(
        name=recipe.name,
        run_dir=run_dir,
        recipe=Path(req.recipe).resolve(),
        overrides=overrides,
        workdir=os.getcwd(),
        python=sys.executable,
        nodes=nodes,
        gpus_per_node=recipe.cluster.gpus_per_node,
        accelerator=recipe.cluster.accelerator,
        lead_s=lead,
        time_limit=req.time,
        partition=req.partition,
        account=req.account,
    )
    path = run_dir / "slurm" / SCRIPT_NAME
    argv = ["sbatch", "--parsable", *req.sbatch_args, str(path)]
    if req.dry_run:
        echo(f"# {path} (not written: --dry-run)")
        echo(text)
        echo(f"# submit with: {shlex.join(argv)}")
        return ExitCode.OK
    if shutil.which("sbatch", path=env.get("PATH")) is None:
        raise UserError("sbatch: not found on PATH: run ftkit submit on a Slurm login node (or use --dry-run)")

    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)
    r = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=120)
    if r.returncode != 0:
        why = " ".join(r.stderr.split()) or f"exit {r.returncode}"
        raise UserError(f"sbatch {path}: {why}")
    job = r.stdout.strip().split(";")[0]
    echo(f"submitted job {job}: {path} (output {run_dir}/slurm/job-{job}.out; ftkit status {run_dir})")
    return ExitCode.OK


# ---------------------------------------------------------------------------------------------------- batch side


def _slurm_event(run_dir: Path, job: str, restarts: int, reason: str, echo: Callable[[str], None]) -> None:

    rec: Event = {
        "time": round(time.time(), 3),
        "event": "slurm",
        "job_id": job,
        "restart_count": restarts,
        "reason": reason,
        "message": f"slurm job {job}: {reason}",
    }
    try:
        append_jsonl(run_dir / "events.jsonl", rec)
    except OSError as e:
        echo(f"ftkit: cannot record the slurm event in {run_dir}/events.jsonl: {e.strerror or e}")
    echo(f"ftkit: slurm job {job}: {reason}")


def _stop_step(run_dir: Path, since: float) -> int | None:
    """The step the graceful stop committed (metrics.jsonl's commit record flagged ``stop``), if one since ``since``."""

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    steps = [
        m.get("step")
        for m in read_metrics(metrics)
        if m.get("event") == "commit" and m.get("stop") and float(m.get("time") or since) >= since
    ]
    return int(steps[-1]) if steps and steps[-1] is not None else None


class _SignalLog:
    """Which signals reached this process while ftkit's own handlers ran: Python writes each caught signal's
    number to the wakeup fd whatever handler is installed, so the launch keeps its handlers and we still learn
    whether Slurm's USR1 was among them."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)
        self.old = signal.set_wakeup_fd(self.w, warn_on_full_buffer=False)

    def seen(self) -> set[int]:
        got = b""
        while True:
            try:
                chunk = os.read(self.r, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            got += chunk
        return set(got)

    def close(self) -> None:
        signal.set_wakeup_fd(self.old)
        os.close(self.r)
        os.close(self.w)


def batch(recipe: str, overrides: Sequence[str], echo: Callable[[str], None] = print) -> int:
    """The Python side of the sbatch script: launch in-process, then requeue on USR1 within the budget."""

    env = os.environ
    job = env.get("SLURM_JOB_ID", "")
    if not job:
        raise UserError(
            "ftkit.run.submit batch runs inside a Slurm batch job (SLURM_JOB_ID is not set): use ftkit submit"
        )
    restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    r = load_recipe(recipe, list(overrides))
    run_dir = Path(r.train.output_dir).resolve()
    budget = r.resilience.max_requeues
    budget = MAX_REQUEUES if budget is None else int(budget)
    early: list[int] = []

    def before_launch(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
        early.append(signum)  # until the launch installs its handlers: nothing runs yet, nothing to save

    for s in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(s, before_launch)
    log = _SignalLog()
    nodes = env.get("SLURM_JOB_NODELIST", "?")
    _slurm_event(
        run_dir,
        job,
        restarts,
        f"started on {nodes}" if not restarts else f"restarted on {nodes} after requeue {restarts}",
        echo,
    )
    started = time.time()
    try:
        if signal.SIGUSR1 in early:  # the notice came before anything started: nothing to save, go straight on
            code = ExitCode.STOPPED
        else:
            code = launch(LaunchRequest(recipe, tuple(overrides)), echo=echo, warn=lambda m: print(m, file=sys.stderr))
    except FtkitError as e:
        for line in e.lines():
            echo(f"ftkit: error: {line}")
        code = e.exit_code
    finally:
        seen = log.seen() | set(early)
        log.close()
    # After ftkit's graceful stop: a TERM now is Slurm ending the job (our requeue, or the grace period's end).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    usr1 = signal.SIGUSR1 in seen
    # stopped by the notice: after a graceful stop (8), or during preflight, before anything started (128+USR1)
    if usr1 and code in (ExitCode.STOPPED, 128 + signal.SIGUSR1):
        step = _stop_step(run_dir, started)
        saved = f"saved step {step}" if step is not None else "nothing new to save"
        if restarts >= budget:
            _slurm_event(
                run_dir,
                job,
                restarts,
                f"USR1 (time limit or preemption): {saved}; requeue budget spent ({restarts} of "
                f"resilience.max_requeues={budget}): the job ends (exit 8)",
                echo,
            )
            return ExitCode.STOPPED
        _slurm_event(
            run_dir,
            job,
            restarts,
            f"USR1 (time limit or preemption): {saved}; requeue {restarts + 1} of {budget}",
            echo,
        )
        q = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        if q.returncode != 0:
            why = " ".join((q.stderr or q.stdout).split()) or f"exit {q.returncode}"
            _slurm_event(run_dir, job, restarts, f"scontrol requeue failed: {why}: the job ends (exit 8)", echo)
            return ExitCode.STOPPED
        return ExitCode.STOPPED
    what = {ExitCode.OK: "finished", ExitCode.STOPPED: "stopped on request (no USR1): not requeued"}.get(
        code, f"ended with exit {code}: not requeued"
    )
    _slurm_event(run_dir, job, restarts, what, echo)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "batch":
        print("usage: python -m ftkit.run.submit batch RECIPE [KEY=VALUE ...]  (what ftkit submit's script runs)")
        return ExitCode.USAGE
    try:
        return batch(args[1], args[2:], echo=lambda m: print(m, flush=True))
    except FtkitError as e:
        for line in e.lines():
            print(f"ftkit: error: {line}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
