"""``ftkit plan --probe``: measure the fastest candidates on one GPU of this machine, then calibrate the plan with them.

DeepSpeed's autotuner's idea without its grid: the plan ranks every candidate by its predicted step time; the ``top``
fastest that fit are each launched for :data:`PROBE_STEPS` optimizer steps with ``ftkit launch`` (the real entry,
engine and supervisor) on one device (``cluster.num_nodes 1``, ``gpus_per_node 1``; the same micro batch, precision,
sequence length and gradient accumulation), in ``RUN/ftkit/probes/<candidate>`` of the recipe's run directory. Their
measured step times then calibrate the step-time model like ``--calibrate`` (:func:`ftkit.plan.load.plan_report`),
which keeps the calibration beside the run for later plans. Communication is not probed (one device): the network
terms stay the recipe's or ``ftkit doctor --bandwidth``'s.

On the cpu accelerator the probe runs one CPU rank the same way (how the tests exercise it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from ftkit.errors import Problem, UserError
from ftkit.plan.comm import ZeroPP
from ftkit.plan.load import PlanReport, plan_report
from ftkit.plan.memory import Fsdp2
from ftkit.recipe.load import load_recipe
from ftkit.rundir.layout import RunDir

PROBE_STEPS = 8  # optimizer steps per probe: a warm-up interval and a save-free median of six
PROBE_TIMEOUT_S = 1800


def probe_dirs(run_dir: str) -> Path:
    return RunDir(run_dir).meta / "probes"


def probe_and_plan(
    recipe_path: str,
    overrides: tuple[str, ...] | list[str],
    *,
    top: int = 2,
    calibrate: tuple[str, ...] | list[str] = (),
    say: Callable[[str], None] = print,
) -> PlanReport:
    """Probe the ``top`` fastest candidates that fit (module docstring), then plan calibrated on them."""
    if top < 1:
        raise UserError(Problem("--probe needs at least 1 candidate", file="command line"))
    first = plan_report(recipe_path, overrides, calibrate=calibrate)
    rep = first.table
    ranked = sorted(
        (e for e in rep.choice.estimates if e.fits and e.candidate.label in rep.predictions),
        key=lambda e: rep.predictions[e.candidate.label].step_time_s,
    )
    chosen = [e.candidate for e in ranked if not isinstance(e.candidate, ZeroPP)][:top]
    if not chosen:
        raise UserError(Problem("nothing fits: there is no candidate to probe", file=recipe_path))
    recipe = load_recipe(recipe_path, list(overrides))
    root = probe_dirs(recipe.train.output_dir)
    runs = []
    for c in chosen:
        slug = re.sub(r"[^a-z0-9]+", "-", c.label.lower()).strip("-")
        d = root / slug
        if d.exists():
            shutil.rmtree(d)  # a probe is a measurement, made again each time
        d.mkdir(parents=True)
        probe = [
            f"train.output_dir={d / 'run'}",
            f"train.global_batch_size={int(recipe.train.micro_batch_size) * first.plan.grad_accum}",
            f"train.max_steps={PROBE_STEPS}",
            f"train.save_steps={PROBE_STEPS}",
            "train.logging_steps=1",
            "cluster.num_nodes=1",
            "cluster.gpus_per_node=1",
            "cluster.hostfile=null",
            "checkpoint.local_dir=null",
            "resilience.max_restarts=0",
        ]
        if isinstance(c, Fsdp2):
            probe += ["train.backend=fsdp2", f"fsdp.reshard_after_forward={str(c.stage == 3).lower()}"]
            probe += [f"fsdp.offload_params={str(c.offload_params != 'none').lower()}", "cluster.engine=accelerate"]
        else:
            probe += ["train.backend=deepspeed", f"zero.stage={c.stage}"]
            probe += [f"zero.offload_optimizer={c.offload_optimizer}", f"zero.offload_params={c.offload_params}"]
        say(f"probe: {c.label}, {PROBE_STEPS} steps on one device ({d / 'run'})")
        proc = subprocess.run(
            [sys.executable, "-m", "ftkit", "launch", recipe_path, *overrides, *probe],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=dict(os.environ),
        )
        (d / "launch.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
            say(f"probe: {c.label} failed (exit {proc.returncode}): {last}")
            continue
        runs.append(str(d / "run"))
    if not runs:
        raise UserError(Problem("every probe failed: nothing to calibrate from (see the lines above)", file=str(root)))
    return plan_report(recipe_path, overrides, calibrate=[*calibrate, *runs])
