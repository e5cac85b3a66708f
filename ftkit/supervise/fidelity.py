"""Resume fidelity: a resumed attempt recomputes steps an earlier attempt already logged; they must agree.

On CPU a run resumed from checkpoint k reproduces the uninterrupted run's losses bit for bit; on GPUs
non-deterministic kernels allow a small relative difference (``resilience.resume_tolerance``). A larger one means the
resumed state is not the logged one (the "resume succeeds but the loss jumps" reports: DeepSpeed#6691, a universal
checkpoint fix in DeepSpeed PR#7601). Beyond the tolerance: an event and a warning; beyond 10x: the run stops
(exit 9). Only steps whose logging window lies wholly after the resume point are compared: HF Trainer logs the mean
loss since its last log, and the first log after a resume averages fewer steps than the original one did. A loss
that is not finite (``inf``, ``nan``) never counts as matching, even the same ``inf`` logged twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ftkit.rundir.records import MetricsRecord

STOP_FACTOR = 10


@dataclass(frozen=True)
class Mismatch:
    step: int
    what: str  # "loss" or "grad_norm"
    logged: float
    now: float
    logged_attempt: int
    rel: float
    stop: bool

    def message(self, tolerance: float) -> str:
        verdict = (
            f"more than {STOP_FACTOR}x resume_tolerance={tolerance:g}"
            if self.stop
            else (f"over resume_tolerance={tolerance:g}")
        )
        finite = math.isfinite(self.logged) and math.isfinite(self.now)
        diff = f"relative difference {self.rel:.2e}" if finite else "not finite, never the same state"
        return (
            f"step {self.step} recomputed after the resume: {self.what} {self.now:.6g}, attempt "
            f"{self.logged_attempt} logged {self.logged:.6g} ({diff}, {verdict})"
        )


def _rel(a: float, b: float, what: str = "loss") -> float:
    """The relative difference of a logged and a recomputed value. A loss that is not finite never matches (an
    ``inf`` recomputed as ``inf`` proves nothing about the restored state: the run diverged either way); a gradient
    norm overflowing again as the same ``inf`` does (fp16 loss scaling skips that step both times)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if what != "loss" and a == b else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@dataclass
class FidelityCheck:
    """Compares each metric of the running attempt with what earlier attempts logged for the same step."""

    tolerance: float
    logging_steps: int
    resume_step: int | None
    logged: dict[int, MetricsRecord] = field(default_factory=dict)  # step -> the earlier attempt's metric

    @classmethod
    def from_metrics(
        cls,
        metrics: Iterable[MetricsRecord],
        attempt: int,
        tolerance: float,
        logging_steps: int,
        resume_step: int | None,
    ) -> FidelityCheck:
        logged: dict[int, MetricsRecord] = {}
        for m in metrics:
            step, earlier = m.get("step"), m.get("attempt")
            if isinstance(m, Mapping) and isinstance(step, int) and isinstance(m.get("loss"), (int, float)):
                if isinstance(earlier, int) and earlier < attempt:
                    logged[step] = m  # the latest earlier attempt's value wins
        return cls(tolerance, max(1, logging_steps), resume_step, logged)

    def observe(self, m: MetricsRecord) -> list[Mismatch]:
        step = m.get("step")
        if self.resume_step is None or not isinstance(step, int) or step not in self.logged:
            return []
        if step - self.resume_step < self.logging_steps:
            return []  # the first window after a resume is shorter than the logged one
        old = self.logged[step]
        out = []
        for what in ("loss", "grad_norm"):
            a, b = old.get(what), m.get(what)
            if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
                continue
            rel = _rel(float(a), float(b), what)
            if rel > self.tolerance:
                stop = rel > STOP_FACTOR * self.tolerance
                out.append(Mismatch(step, what, float(a), float(b), int(old.get("attempt", -1)), rel, stop))
        return out
