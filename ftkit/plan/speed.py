"""Step time without communication: GPU work, host overheads, the optimizer step, offload (docs/design.md,
Communication model; :func:`ftkit.plan.comm.predict` adds the exposed communication).

A fixed MFU cannot rank small-model candidates: measured on an H200 (0.27B Llama, 8192 tokens per step) ZeRO-3 ran at
3.7% MFU, ZeRO-2 at 7.2% and FSDP2 at 10.8%. What the step spends, per micro-step:

* **GPU**: every GEMM of the model's :class:`~ftkit.plan.profile.Profile` at its own size, ``max(2MNK / (peak ×
  η(M,N,K)), bytes / HBM)`` with an efficiency that falls for small dimensions (``η = η_max·x/(x + 128)``, x the
  smallest dimension), attention FLOPs at ``η_attn``, and the memory-bound operators' bytes at HBM bandwidth;
* **host**: the kernels launched (each costs the CPU ``launch_us``: dispatcher and Python, the GPU waits when the
  kernels are short) and the engine's hooks: DeepSpeed ZeRO-1/2 run a gradient hook per trainable tensor, ZeRO-3 a
  hook per module and a fetch/release per module owning parameters and a gradient hook per trainable tensor, FSDP2
  one all-gather/reduce-scatter pair of hooks per unit;

and per optimizer step: the optimizer's read-modify-write of its states at HBM bandwidth, a fixed cost (HF Trainer
and the engine's bookkeeping, the gradient norm), and with offload the CPU optimizer (DeepSpeed's CPU Adam, or
torch's AdamW on the CPU where it cannot be built: ``benchmarks/cpu_adam.py`` measured both) and the PCIe copies.
The GPU and host parts add up (short kernels cannot hide the host's time).

The coefficients have defaults per GPU class (:data:`CLASSES`): the hardware's from data sheets, the host's from the
H200 measurements (``benchmarks/fit_step_model.py`` derives them from tests/plan/data/h200-2026-11-27.json) and, for
CPU ranks, from 2-rank runs here. A :class:`Calibration` scales the GPU and host parts to measured runs (``ftkit
plan --calibrate RUN``, a run directory's own earlier attempts, ``ftkit plan --probe``); :func:`fit` finds the
scales. Arithmetic only (import-light controller).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ftkit.plan.profile import Profile
from ftkit.rundir.records import JSON, JSONObject, as_number


@dataclass(frozen=True)
class GpuClass:
    """Default coefficients of one kind of accelerator (and the host CPU driving it)."""

    name: str
    hbm_gbs: float  # memory bandwidth, GB/s (1e9 bytes)
    matmul_eff: float = 0.70  # the best fraction of peak a large GEMM reaches
    attn_eff: float = 0.45  # flash attention's fraction of peak (forward and backward)
    mem_eff: float = 0.75  # fraction of HBM bandwidth element-wise kernels reach
    launch_us: float = 12.0  # host time per kernel launched (dispatcher, Python of the modules)
    grad_hook_us: float = 680.0  # DeepSpeed ZeRO-1/2: per trainable tensor per micro-step (hook, bucket, step)
    z3_grad_hook_us: float = 1430.0  # DeepSpeed ZeRO-3: per trainable tensor per micro-step
    z3_fetch_us: float = 560.0  # DeepSpeed ZeRO-3: per module owning parameters per micro-step (fetch, release)
    z3_module_us: float = 20.0  # DeepSpeed ZeRO-3: per module per micro-step (its pre/post hooks)
    fsdp_unit_us: float = 1630.0  # FSDP2: per unit per micro-step (all-gather, reduce-scatter and their hooks)
    step_fixed_s: float = 0.040  # per optimizer step: HF Trainer, callbacks, the engine's step, the gradient norm
    pcie_gbs: float = 20.0  # host <-> device copies of offload (PCIe 4 x16, effective)
    cpu_adam_params_per_s: float = 2.9e9  # DeepSpeed's CPU Adam on the node's cores (per rank's share)
    # torch's fused AdamW on the CPU (what ftkit renders when CPU Adam is not used: torch_adam + fused, nothing to
    # build): 1.1-1.2x slower than CPU Adam on the same cores (benchmarks/cpu_adam.py, 50M fp32 parameters: 481 against
    # 386 M/s on 1 thread, 346 against 321 M/s on 2); torch's unfused per-parameter loop would be 6.5-8.7x slower
    torch_adam_params_per_s: float = 2.9e9 / 1.15
    doc: str = ""


# HBM bandwidth per GPU from the vendors' data sheets; the host coefficients are the H200 fit's for every GPU class
# (the host CPU, not the GPU, sets them: calibrate on the real machine).
CLASSES: dict[str, GpuClass] = {
    g.name: g
    for g in (
        GpuClass("h100", 3350.0, doc="H100 SXM"),
        GpuClass("h100-pcie", 2000.0, doc="H100 PCIe"),
        GpuClass("h200", 4800.0, doc="H200 SXM"),
        GpuClass("a100", 2039.0, doc="A100 80GB"),
        GpuClass("a100-40", 1555.0, doc="A100 40GB"),
        GpuClass("l40s", 864.0, doc="L40S"),
        GpuClass("a10", 600.0, doc="A10"),
        GpuClass("l4", 300.0, doc="L4"),
        GpuClass("v100", 900.0, doc="V100"),
        # CPU ranks (gloo): fitted to 2-rank runs of the tests' tiny model on this 2-core machine
        # (benchmarks/fit_step_model.py --cpu); "GPU" work is the CPU's arithmetic
        GpuClass(
            "cpu",
            20.0,
            matmul_eff=0.5,
            attn_eff=0.3,
            mem_eff=0.5,
            launch_us=30.0,
            grad_hook_us=900.0,
            z3_grad_hook_us=1500.0,
            z3_fetch_us=900.0,
            z3_module_us=40.0,
            fsdp_unit_us=2500.0,
            step_fixed_s=0.030,
            pcie_gbs=10.0,
            cpu_adam_params_per_s=0.17e9,  # benchmarks/cpu_adam.py here, 2 threads
            torch_adam_params_per_s=0.17e9 / 1.15,
            doc="a CPU rank (gloo)",
        ),
    )
}


@dataclass(frozen=True)
class CalPoint:
    """One measured run against the model: its step time and the model's parts for the same configuration."""

    run: str  # the run directory (or the probe's name)
    label: str  # the candidate it ran
    measured_s: float
    gpu_s: float  # parts of the uncalibrated prediction
    host_s: float
    other_s: float  # what calibration does not scale: exposed communication, offload
    steps: int = 0  # step intervals the measurement is the median of

    def predicted(self, gpu_scale: float, host_scale: float) -> float:
        return gpu_scale * self.gpu_s + host_scale * self.host_s + self.other_s

    def as_json(self) -> JSONObject:
        return {
            "run": self.run,
            "label": self.label,
            "measured_s": self.measured_s,
            "gpu_s": self.gpu_s,
            "host_s": self.host_s,
            "other_s": self.other_s,
            "steps": self.steps,
        }

    @staticmethod
    def from_json(d: JSONObject) -> CalPoint:
        def num(key: str) -> float:
            v = as_number(d.get(key))
            if v is None:
                raise ValueError(f"{key} is not a number")
            return v

        return CalPoint(
            str(d.get("run", "")),
            str(d.get("label", "")),
            num("measured_s"),
            num("gpu_s"),
            num("host_s"),
            num("other_s"),
            int(as_number(d.get("steps")) or 0),
        )


@dataclass(frozen=True)
class Calibration:
    """Scales of the GPU and host parts fitted to measured runs of one GPU class, and how well they fit."""

    gpu_class: str
    gpu_scale: float = 1.0
    host_scale: float = 1.0
    points: tuple[CalPoint, ...] = ()
    error: float = 0.0  # the largest relative error of the fit on its own points (leave-one-out with 3 or more)
    source: str = ""  # where the points came from (one line)

    def as_json(self) -> JSONObject:
        return {
            "version": 1,
            "gpu_class": self.gpu_class,
            "gpu_scale": self.gpu_scale,
            "host_scale": self.host_scale,
            "error": self.error,
            "source": self.source,
            "points": [p.as_json() for p in self.points],
        }

    @staticmethod
    def from_json(d: JSONObject) -> Calibration:
        raw = d.get("points")
        points = tuple(CalPoint.from_json(p) for p in raw if isinstance(p, dict)) if isinstance(raw, list) else ()
        return Calibration(
            str(d.get("gpu_class", "")),
            as_number(d.get("gpu_scale")) or 1.0,
            as_number(d.get("host_scale")) or 1.0,
            points,
            as_number(d.get("error")) or 0.0,
            str(d.get("source", "")),
        )


MIN_SCALE, MAX_SCALE = 0.05, 50.0


def _clamp(x: float) -> float:
    return min(MAX_SCALE, max(MIN_SCALE, x))


def _scales(points: Sequence[CalPoint]) -> tuple[float, float]:
    """(gpu, host) scales minimising the squared relative error; one point (or parts that do not separate): the
    host scale alone, the GPU part from the data sheet being the better known."""
    if not points:
        return 1.0, 1.0
    # weighted least squares on relative errors: rows (gpu_s/m, host_s/m) · (g, h) = 1 - other_s/m
    a11 = a12 = a22 = y1 = y2 = 0.0
    for p in points:
        m = p.measured_s
        x1, x2, y = p.gpu_s / m, p.host_s / m, 1 - p.other_s / m
        a11, a12, a22 = a11 + x1 * x1, a12 + x1 * x2, a22 + x2 * x2
        y1, y2 = y1 + x1 * y, y2 + x2 * y
    det = a11 * a22 - a12 * a12
    if len(points) >= 2 and det > 1e-6 * max(a11 * a22, 1e-30):
        g, h = (y1 * a22 - y2 * a12) / det, (a11 * y2 - a12 * y1) / det
        if g > MIN_SCALE and h > MIN_SCALE:
            return _clamp(g), _clamp(h)
    # host alone (GPU part kept); if the GPU part alone is already too slow, scale both together
    rest = sum(p.measured_s - p.other_s - p.gpu_s for p in points)
    host = sum(p.host_s for p in points)
    if host > 0 and rest > MIN_SCALE * host:
        return 1.0, _clamp(rest / host)
    both = sum(p.gpu_s + p.host_s for p in points)
    k = sum(p.measured_s - p.other_s for p in points) / both if both > 0 else 1.0
    return _clamp(k), _clamp(k)


def fit(gpu_class: str, points: Sequence[CalPoint], source: str) -> Calibration:
    """The calibration of ``points`` (module docstring), with its expected error: the largest relative error when
    each point is predicted from the others (3 points or more), else on the points themselves."""
    g, h = _scales(points)
    if len(points) >= 3:
        errs = []
        for i, p in enumerate(points):
            gi, hi = _scales([q for j, q in enumerate(points) if j != i])
            errs.append(abs(p.predicted(gi, hi) - p.measured_s) / p.measured_s)
        error = max(errs)
    else:
        error = max((abs(p.predicted(g, h) - p.measured_s) / p.measured_s for p in points), default=0.0)
    return Calibration(gpu_class, g, h, tuple(points), error, source)


# ------------------------------------------------------------------------------------------------ the model


def gemm_s(m: int, n: int, k: int, peak: float, cls: GpuClass, bytes_per: int) -> float:
    """One GEMM: compute at a size-dependent efficiency or its operands through HBM, whichever is slower."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    x = min(m, n, k)
    eff = cls.matmul_eff * x / (x + 128)
    flops = 2.0 * m * n * k
    moved = bytes_per * (m * k + k * n + m * n)
    return max(flops / (peak * eff), moved / (cls.hbm_gbs * 1e9))


@dataclass(frozen=True)
class Parts:
    """One optimizer step's time by part (seconds), before communication."""

    gpu_s: float  # GA micro-steps of GEMMs, attention, memory-bound work, plus the optimizer's pass over its states
    host_s: float  # GA micro-steps of launches and engine hooks, plus the step's fixed cost
    offload_s: float  # CPU optimizer and PCIe copies (offload only)
    flops: float  # matmul + attention FLOPs per step (for MFU)
    detail: dict[str, float] = field(default_factory=dict)

    def scaled(self, cal: Calibration | None) -> Parts:
        if cal is None:
            return self
        return replace(self, gpu_s=self.gpu_s * cal.gpu_scale, host_s=self.host_s * cal.host_scale)


@dataclass(frozen=True)
class Engine:
    """What of the engine the step time depends on."""

    kind: str  # "deepspeed" | "fsdp2"
    stage: int
    offload_optimizer: str  # none | cpu | nvme
    offload_params: str
    fsdp_units: int = 0
    cpu_adam: bool = True  # DeepSpeed's CPU Adam (else torch's AdamW on the CPU)


def step_parts(
    prof: Profile,
    *,
    seq_len: int,
    micro_batch: int,
    grad_accum: int,
    k: int,
    peak_flops: float,
    cls: GpuClass,
    engine: Engine,
    trainable_part: int,
    weight_part: int,
    attn_scale: float = 1.0,
    work_share: float = 1.0,
) -> Parts:
    """The step's parts for one rank (module docstring). ``trainable_part``: trainable elements this rank updates;
    ``weight_part``: parameter elements it holds (offload's copies). Sequence parallelism passes its local
    ``seq_len`` and ``attn_scale`` = its degree (each rank attends over the whole sequence for its share of the
    heads); tensor parallelism ``work_share`` = 1/degree of the matmul, attention and memory-bound work."""
    s, b = seq_len, micro_batch
    tokens = s * b
    gemm = sum(g.count * gemm_s(*g.dims(tokens), peak_flops, cls, k) for g in prof.gemms)
    if not prof.gemms:  # no shapes (closed form without tensors): all matmul FLOPs at the best efficiency
        gemm = prof.matmul_flops.at(s, b, prof.layers) / (peak_flops * cls.matmul_eff)
    attn = attn_scale * prof.attn_flops.at(s, b, prof.layers) / (peak_flops * cls.attn_eff)
    mem = prof.mem_bytes.at(s, b, prof.layers) / (cls.hbm_gbs * 1e9 * cls.mem_eff)
    if work_share != 1.0:
        gemm, attn, mem = gemm * work_share, attn * work_share, mem * work_share
    launches = prof.launches.at(s, b, prof.layers) * cls.launch_us * 1e-6
    hk = prof.hooks
    if engine.kind == "fsdp2":
        hooks = engine.fsdp_units * cls.fsdp_unit_us
    elif engine.stage == 3:
        hooks = (
            hk.trainable_tensors * cls.z3_grad_hook_us
            + hk.modules_with_params * cls.z3_fetch_us
            + hk.modules * cls.z3_module_us
        )
    else:
        hooks = hk.trainable_tensors * cls.grad_hook_us
    hooks *= 1e-6
    on_gpu = engine.offload_optimizer == "none"
    opt_gpu = trainable_part * (28 + k) / (cls.hbm_gbs * 1e9 * cls.mem_eff) if on_gpu else 0.0
    offload = 0.0
    if not on_gpu:
        rate = cls.cpu_adam_params_per_s if engine.cpu_adam else cls.torch_adam_params_per_s
        # the CPU optimizer, then the updated k-bit partition back to the GPU (gradients go down during backward)
        offload = trainable_part / rate + k * trainable_part / (cls.pcie_gbs * 1e9)
        if engine.offload_optimizer == "nvme":
            offload += 24 * trainable_part / 2e9  # states swapped in and out at ~2 GB/s (a local NVMe)
    if engine.offload_params != "none":
        offload += grad_accum * 2 * k * weight_part / (cls.pcie_gbs * 1e9)
    micro_gpu = gemm + attn + mem
    micro_host = launches + hooks
    flops = (prof.matmul_flops.at(s, b, prof.layers) + attn_scale * prof.attn_flops.at(s, b, prof.layers)) * grad_accum
    flops *= work_share
    return Parts(
        gpu_s=grad_accum * micro_gpu + opt_gpu,
        host_s=grad_accum * micro_host + cls.step_fixed_s,
        offload_s=offload,
        flops=flops,
        detail={
            "gemm_s": grad_accum * gemm,
            "attention_s": grad_accum * attn,
            "memory_bound_s": grad_accum * mem,
            "optimizer_gpu_s": opt_gpu,
            "launches_s": grad_accum * launches,
            "hooks_s": grad_accum * hooks,
            "step_fixed_s": cls.step_fixed_s,
            "offload_s": offload,
        },
    )


def gpu_class(gpu: str) -> GpuClass:
    return CLASSES.get(gpu, CLASSES["h100"])


def expected_error_line(cal: Calibration | None, gpu: str) -> str:
    """``ftkit plan``'s line on how far to trust its step times."""
    if cal is None or not cal.points:
        return f"step times uncalibrated (defaults for {gpu_class(gpu).doc or gpu}; docs/accuracy.md)"
    n = len(cal.points)
    return (
        f"step times calibrated on {n} measured run{'s' if n > 1 else ''} ({cal.source}): GPU x{cal.gpu_scale:.2f}, "
        f"host x{cal.host_scale:.2f}; expected error ±{expected_error(cal):.0%}"
    )


# With fewer than three runs the fit has no points left over to test itself on: the error measured for a calibration
# from one run (docs/accuracy.md: the H200 cases from ZeRO-2's alone, the CPU runs across micro batches) stands in.
SINGLE_RUN_ERROR = 0.25


def expected_error(cal: Calibration) -> float:
    return max(cal.error, SINGLE_RUN_ERROR if len(cal.points) < 3 else 0.02)


def as_json_number(x: float) -> JSON:
    return round(x, 6) if math.isfinite(x) else None
