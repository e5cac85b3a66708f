"""DeepSpeed's compiled ops at launch: settle what the optimizer needs from what every host has, and build what is
missing once per host before any rank starts (docs/design.md, Rendering rules; issue 35).

The preflight's facts probe reports, per host, the ops DeepSpeed has prebuilt and what a build needs there
(:mod:`ftkit.cluster.toolchain`); :func:`ftkit.run.doctor_checks.check_ops` has already refused (exit 3) an op
the plan needs that a host can neither load nor build. Then:

* :func:`cpu_adam_everywhere` answers ``zero.cpu_adam: auto`` (optimizer offload): DeepSpeed's CPU Adam only when
  every host can load it, else torch's AdamW on the CPU; the launch rebuilds its plan with the answer;
* :func:`warm_up` runs ``python -m ftkit.launch.warmup`` once on each host that must build an op (neither prebuilt
  nor left built by an earlier run), with the ranks' environment: N ranks do not queue behind one build lock, the
  build does not count against ``resilience.startup_timeout_s``, and a build error is one line per host, exit 3,
  before anything is spawned (the build's output in a ``ftkit-warmup-*`` temporary directory the line names).
"""

from __future__ import annotations

import json
import shlex
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

from ftkit.cluster.fanout import run_on_hosts
from ftkit.cluster.toolchain import ToolchainFacts, op_problems
from ftkit.errors import PreflightError
from ftkit.plan.knobs import compiled_ops
from ftkit.rundir.layout import atomic_write

if TYPE_CHECKING:
    from ftkit.cluster.fanout import Transport
    from ftkit.plan.plan import Plan

MARK = "FTKIT_WARMUP "  # ftkit.launch.warmup's last line


class BuildResult(TypedDict, total=False):
    """One op's build as ``python -m ftkit.launch.warmup --json`` reports it (``ok`` None: not on this accelerator)."""

    ok: bool | None
    seconds: float
    error: str


def cpu_adam_everywhere(plan: Plan, toolchain: Mapping[str, ToolchainFacts]) -> bool | None:
    """For ``zero.cpu_adam: auto`` with optimizer offload: whether every host of the plan can load DeepSpeed's CPU
    Adam (prebuilt, or buildable there); None when the question does not arise (no offload, or not auto)."""
    r = plan.recipe
    if plan.offload_optimizer == "none" or r.zero.cpu_adam != "auto" or r.train.backend != "deepspeed":
        return None
    hosts = [h for h, _ in plan.hosts]
    return all(h in toolchain and not op_problems("cpu_adam", toolchain[h], r.cluster.accelerator) for h in hosts)


def settle_optimizer(
    plan: Plan, toolchain: Mapping[str, ToolchainFacts], replan: Callable[[bool], Plan]
) -> tuple[Plan, str | None]:
    """The plan with ``zero.cpu_adam: auto`` answered by the hosts (``replan(cpu_adam_ok)``), and the line that says
    so (None when nothing was decided)."""
    ok = cpu_adam_everywhere(plan, toolchain)
    if ok is None:
        return plan, None
    if ok:
        return replan(True), "optimizer: DeepSpeed's CPU Adam steps the offloaded states (every host can load it)"
    accel = plan.recipe.cluster.accelerator
    cannot = [h for h, _ in plan.hosts if h not in toolchain or op_problems("cpu_adam", toolchain[h], accel)]
    plan = replan(False)
    return plan, (
        f"optimizer: torch's AdamW steps the offloaded states on the CPU (slower): DeepSpeed's CPU Adam cannot be "
        f"built on {', '.join(cannot) or 'every host'} (ftkit doctor says why; zero.cpu_adam true requires it)"
    )


def to_build(plan: Plan, toolchain: Mapping[str, ToolchainFacts]) -> dict[str, list[str]]:
    """host -> the ops the plan needs that are neither prebuilt there nor left built by an earlier build."""
    accel = plan.recipe.cluster.accelerator
    out: dict[str, list[str]] = {}
    for host, _ in plan.hosts:
        facts = toolchain.get(host, {})
        need = [
            op
            for op in compiled_ops(plan)
            if not (op in facts.get("ds_prebuilt", []) and facts.get("ds_accelerator") == accel)
            and op not in facts.get("jit_cached", [])
        ]
        if need:
            out[host] = need
    return out


def warm_up(
    plan: Plan,
    toolchain: Mapping[str, ToolchainFacts],
    *,
    env: Mapping[str, str],
    python: str,
    ssh_args: list[str],
    deadline_s: float,
    transport: Transport | None = None,
) -> list[str]:
    """Build what :func:`to_build` lists, once per host, with ``env`` (the ranks' variables that decide a build);
    returns one line per host built. Raises PreflightError (exit 3) with one line per failed build."""
    todo = to_build(plan, toolchain)
    if not todo:
        return []

    def line(host: str) -> str:
        words = ["exec", "env", *(f"{k}={v}" for k, v in env.items()), python, "-m", "ftkit.launch.warmup"]
        return shlex.join([*words, "--ops", ",".join(todo[host]), "--json"]) + " 2>&1"

    results = run_on_hosts(list(todo), line, ssh_args, deadline_s=deadline_s, transport=transport)
    # a build the deadline killed left torch's build lock: every later launch on that host would wait on it (or be
    # refused by the preflight's stale-lock check), so the lock no process holds is removed there at once
    unfinished = {h: ops for h, ops in todo.items() if _parse(results[h].out) is None}
    cleared: dict[str, str] = {}
    if unfinished:

        def clear(host: str) -> str:
            words = ["exec", "env", *(f"{k}={v}" for k, v in env.items()), python, "-m", "ftkit.cluster.buildlocks"]
            return shlex.join([*words, "--clear", ",".join(unfinished[host])]) + " 2>&1"

        after = run_on_hosts(list(unfinished), clear, ssh_args, deadline_s=60.0, transport=transport)
        for host, res in after.items():
            removed = [x.removeprefix("removed ") for x in res.out.splitlines() if x.startswith("removed ")]
            if removed:
                cleared[host] = f"; removed the build lock its killed build left: {', '.join(removed)}"
    done, problems = [], []
    logs: Path | None = None
    for host, ops in todo.items():
        res = results[host]
        parsed = _parse(res.out) if res.reachable else None
        failed = [op for op in ops if parsed is None or (parsed.get(op) or {}).get("ok") is False]
        if not failed and parsed is not None:
            took = sum(float((parsed.get(op) or {}).get("seconds", 0.0)) for op in ops)
            done.append(f"host {host}: built {', '.join(ops)} once before the ranks ({took:.0f}s)")
            continue
        # a refused launch leaves the run directory as it found it: the build's output goes to a directory of its
        # own, named in the line
        logs = logs or Path(tempfile.mkdtemp(prefix="ftkit-warmup-"))
        log = logs / f"{host}.log"
        atomic_write(log, res.out, fsync=False)
        if parsed is None:
            why = res.out.strip() if not res.reachable else f"exit {res.rc}, no result"
            problems.append(
                f"host {host}: ops: building {', '.join(ops)} did not finish: {why} (log: {log}){cleared.get(host, '')}"
            )
            continue
        for op in failed:
            problems.append(
                f"host {host}: ops: building {op} failed: {(parsed.get(op) or {}).get('error', '?')} (log: {log}) "
                "[ftkit doctor checks the toolchain; zero.cpu_adam false needs no build]"
            )
    if problems:
        raise PreflightError("\n".join(problems))
    return done


def _parse(out: str) -> dict[str, BuildResult] | None:
    for text in reversed(out.splitlines()):
        if text.startswith(MARK):
            try:
                return cast("dict[str, BuildResult]", json.loads(text[len(MARK) :]))
            except ValueError:
                return None
    return None
