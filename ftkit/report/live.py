"""What ``ftkit launch`` does for the report: records what only the launch knows, and keeps ``RUN/report.html`` current.

* :func:`plan_record`: the plan's figures (stage, memory per GPU, predicted step time, FLOPs per token, the GPU's
  peak) for one ``plan`` event at launch, so a report needs nothing but events.jsonl and metrics.jsonl;
* (the supervisor's :func:`ftkit.supervise.stragglers.record_step_times`): after each attempt's teardown, every rank's
and host's compute time per step (from   the heartbeats, which the next attempt overwrites) as one ``step_times`` event;
* :class:`ReportRefresher`: renders the page in a detached ``python -m ftkit report`` after an attempt (at most once
  a minute), so the supervisor never waits for matplotlib; the launch waits for the last render only when it ends
  (a bounded wait), and a render that fails is one warning line, never a failed run. ``FTKIT_REPORT=off``
  (:func:`launch_refresher`): the launch renders nothing, and ``ftkit report RUN`` makes the page when asked.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from ftkit.model.shape import count_params
from ftkit.plan.candidates import predict_plan
from ftkit.rundir.layout import RunDir

if TYPE_CHECKING:
    from ftkit.plan.plan import Plan

REPORT_NAME = "report.html"
FINISH_TIMEOUT_S = 30.0  # the launch's wait for its last render (one takes ~1-2 s here)
PREVIOUS_WAIT_S = 5.0  # a render still running when the next attempt ends: waited for this long, then stopped
# Renders start at most this often: an attempt that ends sooner after the launch's start or the last render has its
# render started when that much time has passed (or by the launch's end, which always renders). A crash loop of
# attempts seconds apart renders once a minute, not once per attempt (each render costs a CPU-second or two of the
# head node: matplotlib's import and four charts), and the page never lags an attempt's end by more than a minute.
REFRESH_EVERY_S = 60.0
# auto (the default): the launch keeps RUN/report.html current | off: it renders none (each render is a CPU-second or
# two of the head node; the test suite's runs, whose page no test reads, are launched so)
REPORT_ENV = "FTKIT_REPORT"


class PlanRecord(TypedDict, total=False):
    """:func:`plan_record`: the ``plan`` event's fields (besides ``time``, ``event`` and ``attempt``). The first
    fourteen are always there; then either the prediction's figures or ``not_estimated``."""

    engine: str
    accelerator: str
    hosts: list[list[str | int]]  # [host, processes] in rank order
    world_size: int
    stage: int
    offload_optimizer: str
    offload_params: str
    precision: str
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    seq_len: int
    gpu_memory_gb: float
    lora: bool
    gpu: str | None
    gpu_doc: str | None
    gpu_source: str | None
    peak_tflops: float | None
    assumed_mfu: float | None
    flops_per_token: float | None
    predicted_step_s: float
    predicted_compute_s: float
    predicted_exposed_comm_s: float
    predicted_tokens_per_s: float
    tokens_per_step: int
    memory_gib_per_gpu: float | None
    total_params: int | None
    trainable_params: int | None
    not_estimated: str  # why the figures are missing


def plan_record(plan: Plan) -> PlanRecord:
    """The plan's figures for the ``plan`` event. The step-time model needs the model's parameter counts: when they
    cannot be had cheaply (a family without a closed form would import transformers into the supervisor, or a
    user command's model that the plan could not read), the record says why instead."""
    r = plan.recipe
    rec: PlanRecord = {
        "engine": r.cluster.engine,
        "accelerator": r.cluster.accelerator,
        "hosts": [[h, n] for h, n in plan.hosts],
        "world_size": plan.world_size,
        "stage": plan.stage,
        "offload_optimizer": plan.offload_optimizer,
        "offload_params": plan.offload_params,
        "precision": r.train.precision,
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum": plan.grad_accum,
        "global_batch_size": plan.global_batch_size,
        "seq_len": r.data.max_seq_len,
        "gpu_memory_gb": r.cluster.gpu_memory_gb,
        "lora": bool(r.has_peft),
    }
    try:
        if plan.unknown:
            raise ValueError("; ".join(plan.unknown))
        if plan.memory is None and count_params(plan.model_config) is None:
            raise ValueError("the model's family has no closed-form parameter count (run `ftkit plan` for it)")
        p = copy.copy(plan)  # predict_plan fills in plan.memory: leave the launch's plan as it was
        pred = predict_plan(p)
        a = pred.assumptions
        sel = p.memory.selected if p.memory is not None else None
        rec.update(
            {
                "gpu": a.get("gpu"),
                "gpu_doc": a.get("gpu_doc"),
                "gpu_source": a.get("gpu_source"),
                "peak_tflops": a.get("peak_tflops"),
                "assumed_mfu": a.get("mfu"),
                "flops_per_token": a.get("flops_per_token"),
                "predicted_step_s": round(pred.step_time_s, 6),
                "predicted_compute_s": round(pred.compute_s, 6),
                "predicted_exposed_comm_s": round(pred.exposed_comm_s, 6),
                "predicted_tokens_per_s": round(pred.tokens_per_s, 1),
                "tokens_per_step": pred.tokens_per_step,
                "memory_gib_per_gpu": round(sel.total_gb, 3) if sel is not None else None,
                "total_params": p.memory.shape.total_params if p.memory is not None else None,
                "trainable_params": p.memory.workload.phi if p.memory is not None else None,
            }
        )
    except Exception as e:  # noqa: BLE001 - the record is informative; it must never stop a launch
        rec["not_estimated"] = str(e) or type(e).__name__
    return rec


def launch_refresher(
    rd: RunDir, warn: Callable[[str], None], environ: Mapping[str, str] = os.environ
) -> ReportRefresher | None:
    """What keeps ``RUN/report.html`` current during a launch: None with ``FTKIT_REPORT=off``; another value than
    ``auto`` and ``off`` is one warning line, and the page is kept current."""
    value = environ.get(REPORT_ENV, "auto").strip().lower()
    if value == "off":
        return None
    if value not in ("auto", ""):
        given = environ[REPORT_ENV]
        warn(f"ftkit: warning: {REPORT_ENV}={given!r} is neither auto nor off: report.html is kept current")
    return ReportRefresher(rd, warn)


class ReportRefresher:
    """Renders ``RUN/report.html`` in a detached process after an attempt (:meth:`refresh`, at most once per
    ``every_s``: a render due sooner starts on a timer thread when that much time has passed) and once more when the
    launch ends (:meth:`finish`, the only wait). Renders write atomically, so a reader never sees half a page."""

    def __init__(self, rd: RunDir, warn: Callable[[str], None], every_s: float = REFRESH_EVERY_S):
        self.rd = rd
        self.warn = warn
        self.out = rd.path / REPORT_NAME
        self.log = rd.meta / "report.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._warned = False
        self.waited_s = 0.0  # what the launch spent waiting for renders (measured by the tests)
        self.every_s = every_s
        self.started = time.monotonic()  # the launch's start, then the last render's
        self.skipped = 0  # refreshes left to a later render (within every_s of the previous)
        self._lock = threading.Lock()  # the deferred render's timer thread and the supervisor's thread
        self._timer: threading.Timer | None = None

    @property
    def pending(self) -> bool:
        """Whether a deferred render is waiting for its time."""
        return self._timer is not None

    def refresh(self) -> None:
        """After an attempt: a render now, or, when one started (or the launch began) less than ``every_s`` ago, a
        render once ``every_s`` has passed since."""
        with self._lock:
            wait = self.started + self.every_s - time.monotonic()
            if wait <= 0:
                self._render()
                return
            self.skipped += 1
            if self._timer is None:
                self._timer = threading.Timer(wait, self._deferred)
                self._timer.daemon = True
                self._timer.start()

    def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """The last render, with every event of the launch in it (a deferred one is not needed any more); waits at
        most ``timeout_s``."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._render()
            self._reap(timeout_s)

    def _deferred(self) -> None:
        with self._lock:
            if self._timer is None:  # cancelled by finish() while this thread waited for the lock
                return
            self._timer = None
            self._render()

    def _render(self) -> None:
        """Start a render now (after the previous one ended, or was stopped after :data:`PREVIOUS_WAIT_S`)."""
        self._reap(PREVIOUS_WAIT_S)
        self.started = time.monotonic()
        try:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "wb") as err:
                self._proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ftkit",
                        "report",
                        str(self.rd.path.resolve()),
                        "-o",
                        str(self.out.resolve()),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,  # a Ctrl-C to the terminal is the supervisor's to handle, not the render's
                    # `-m` imports from the working directory first: the run directory has an ftkit/ folder of its
                    # own, so run where this very ftkit package lives
                    cwd=str(Path(__file__).resolve().parents[2]),
                )
        except OSError as e:
            self._warn(f"cannot start it ({e.strerror or e})")

    def _reap(self, timeout_s: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        t0 = time.monotonic()
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, 9)  # its own session: the render and anything it started
            except OSError:
                pass
            proc.wait()
            code = None
        self.waited_s += time.monotonic() - t0
        if code is None:
            self._warn(f"the render took more than {timeout_s:g}s and was stopped")
        elif code != 0:
            self._warn(_last_line(self.log) or f"exit {code}")

    def _warn(self, why: str) -> None:
        if not self._warned:  # one line per launch: the run itself is fine
            self._warned = True
            self.warn(f"ftkit: warning: could not write {self.out}: {why}")


def _last_line(path: Path) -> str:
    try:
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1].removeprefix("ftkit: error: ")[:300] if lines else ""
