"""What one training step of the model keeps in memory and does, per sequence length and batch: its profile.

Memory (docs/design.md, Memory planning) and step time (Communication model) are built from a :class:`Profile`:
the bytes autograd saves, the most bytes live at once in forward and backward (the loss's temporaries included),
the matmul FLOPs and their GEMM shapes, the memory-bound bytes, the kernels launched, and the modules and tensors
the engines hook. Each is a :class:`Series` in the sequence length s and micro batch b,
``c0 + c1·s + c2·s·b + c3·s² + c4·s²·b`` outside the decoder layers plus L times the same per layer.

Where it comes from, best first:

* **traced**: ``python -m ftkit.launch.trace`` builds the real HF model from its config on the meta device and runs a
  training step at a few tiny (s, b) with 1 and 2 layers (:mod:`ftkit.launch.trace`); the differences give the
  per-layer and outside parts and the points the five coefficients. The answer is cached by the config's hash, the
  dtype, LoRA, checkpointing and the versions of torch, transformers and peft (``$FTKIT_PROFILE_CACHE`` or
  ``~/.cache/ftkit/profiles``), so only the first ``ftkit plan`` of a model pays the subprocess (seconds);
* **closed form**: when tracing is off (``FTKIT_PROFILE=formula``), fails (torch missing, an architecture that
  cannot run on the meta device), the counts measured for HF decoders with SDPA: per token and layer
  ``(4+k)·h`` per RMSNorm, ``k·h`` shared input of q/k/v, q and the attention output ``k·h_q`` each, k and v
  ``k·h_kv`` each, the MLP input ``k·h`` and SwiGLU's four ``k·I`` tensors (bf16: ``20h + 4·h_kv + 8I`` with
  h_q = h), Korthikanti's ``34·h`` for other families; eager attention adds ``6·a·s``; the loss saves its fp32
  log-softmax (``4·V`` per token) and peaks ``8·V`` above that in backward. The plan says which it used.

The subprocess and the cache are the only I/O here (:func:`load_profile`, called by :mod:`ftkit.plan.inputs`);
everything else is arithmetic on the standard library (import-light controller).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ftkit.cluster.pkgversions import versions
from ftkit.model.shape import ModelShape
from ftkit.rundir.env import ftkit_cache
from ftkit.rundir.layout import atomic_write
from ftkit.rundir.records import JSON, JSONObject, as_int

TRACER_VERSION = 1  # launch/trace.py's VERSION: a cached answer of another version is traced again
PROFILE_ENV = "FTKIT_PROFILE"  # auto (default): cache, else trace, else closed form | formula: never trace
CACHE_ENV = "FTKIT_PROFILE_CACHE"
TRACE_TIMEOUT_S = 300
# (s, b) points of a trace: three sequence lengths at b=2 and two more batches separate s, s·b, s² and s²·b (no b=1:
# HF models take another path or two for one sequence, a few bytes that a fit would read as a curve); at (37, 3) a
# GEMM dimension that is a multiple of 111 tokens is the token dimension
POINTS = ((32, 2), (64, 2), (96, 2), (32, 4), (37, 3))
SHAPE_POINT = (37, 3)
BASIS = ("1", "s", "s*b", "s^2", "s^2*b")
LOSS_PEAK_V = 8  # bytes per token per vocabulary entry the loss holds in backward beyond its saved fp32 log-softmax


def _basis(s: float, b: float) -> tuple[float, float, float, float, float]:
    return (1.0, s, s * b, s * s, s * s * b)


@dataclass(frozen=True)
class Series:
    """A quantity of one micro-step: outside the layers plus ``layers`` times per layer, each in :data:`BASIS`."""

    outside: tuple[float, ...] = (0.0,) * 5
    per_layer: tuple[float, ...] = (0.0,) * 5

    def at(self, s: float, b: float, layers: int) -> float:
        x = _basis(s, b)
        return sum(c * v for c, v in zip(self.outside, x, strict=True)) + layers * sum(
            c * v for c, v in zip(self.per_layer, x, strict=True)
        )

    def layer(self, s: float, b: float) -> float:
        return sum(c * v for c, v in zip(self.per_layer, _basis(s, b), strict=True))

    def scaled(self, factor: float) -> Series:
        return Series(tuple(c * factor for c in self.outside), tuple(c * factor for c in self.per_layer))


@dataclass(frozen=True)
class Gemm:
    """A matrix multiply of one micro-step, ``count`` times: dimensions as numbers, or (a negative -j) j × tokens."""

    m: int
    n: int
    k: int
    count: float  # per micro-step (per layer ones already multiplied by the layer count)

    def dims(self, tokens: int) -> tuple[int, int, int]:
        return tuple(d if d >= 0 else -d * tokens for d in (self.m, self.n, self.k))  # type: ignore[return-value]


@dataclass(frozen=True)
class Hooks:
    """What the engines' per-module and per-tensor hooks are counted on, for the whole model."""

    modules: int = 0
    modules_with_params: int = 0
    param_tensors: int = 0
    trainable_tensors: int = 0


@dataclass(frozen=True)
class Profile:
    """One training micro-step of the model (module docstring). Bytes, FLOPs and kernel launches per rank."""

    source: str  # "traced" | "closed form"
    why: str  # one line: how it was obtained (the cache, the trace's versions, or why the closed form)
    layers: int
    saved: Series  # bytes autograd keeps from forward to backward
    peak: Series  # the most bytes live at once in forward or backward, gradients left out (loss temporaries in)
    largest_grad_bytes: int = 0  # the largest gradient tensor: there at once before the engine's hook takes it
    matmul_flops: Series = field(default_factory=Series)
    attn_flops: Series = field(default_factory=Series)
    mem_bytes: Series = field(default_factory=Series)  # read + written by the memory-bound operators
    launches: Series = field(default_factory=Series)  # kernels launched (forward and backward)
    gemms: tuple[Gemm, ...] = ()
    hooks: Hooks = field(default_factory=Hooks)
    variant: str = ""  # "zero3": DeepSpeed ZeRO-3's linear (saves every input; LoRA's frozen layers too)

    def activation_bytes(self, s: int, b: int) -> int:
        return int(self.saved.at(s, b, self.layers))

    def peak_bytes(self, s: int, b: int) -> int:
        return int(self.peak.at(s, b, self.layers))

    def line(self) -> str:
        return f"activations {self.source}: {self.why}"


# ------------------------------------------------------------------------------------------------ fitting


def _solve(rows: list[list[float]], values: list[float]) -> tuple[float, ...]:
    """Least squares ``rows · c = values`` (normal equations, Gaussian elimination with partial pivoting)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    y = [sum(r[i] * v for r, v in zip(rows, values, strict=True)) for i in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-30:
            continue
        a[col], a[piv], y[col], y[piv] = a[piv], a[col], y[piv], y[col]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * z for x, z in zip(a[r], a[col], strict=True)]
                y[r] -= f * y[col]
    return tuple(y[i] / a[i][i] if abs(a[i][i]) >= 1e-30 else 0.0 for i in range(n))


def _scale_rows(points: Sequence[tuple[int, int]]) -> tuple[list[list[float]], list[float]]:
    """The basis at each point, each column scaled to about 1 (s² at s=96 is ~1e4: the normal equations would lose
    digits), and the scales to undo."""
    raw = [list(_basis(s, b)) for s, b in points]
    scales = [max(abs(r[i]) for r in raw) or 1.0 for i in range(5)]
    return [[x / sc for x, sc in zip(r, scales, strict=True)] for r in raw], scales


def fit(points: Sequence[tuple[int, int]], values: Sequence[float]) -> tuple[float, ...]:
    """The five coefficients of :data:`BASIS` through ``values`` at ``points``; coefficients within 1e-9 of the
    largest term's size are zero (integers in, integers' worth of noise out)."""
    rows, scales = _scale_rows(points)
    c = _solve(rows, [float(v) for v in values])
    out = tuple(x / sc for x, sc in zip(c, scales, strict=True))
    big = max((abs(v) for v in values), default=0.0)
    return tuple(0.0 if abs(x) * max(scales) < 1e-9 * big else x for x in out)


def _series(traces: list[JSONObject], key: str) -> Series:
    """outside and per-layer coefficients of ``key`` from the traces at depth 1 and 2."""
    by: dict[int, dict[tuple[int, int], float]] = {1: {}, 2: {}}
    for t in traces:
        d = as_int(t.get("depth")) or 0
        if d in by:
            by[d][(as_int(t["s"]) or 0, as_int(t["b"]) or 0)] = float(_num(t[key]))
    pts = sorted(set(by[1]) & set(by[2]))
    per = [by[2][p] - by[1][p] for p in pts]
    out = [by[1][p] - x for p, x in zip(pts, per, strict=True)]
    return Series(fit(pts, out), fit(pts, per))


def _constant(traces: list[JSONObject], keys: tuple[str, ...]) -> Series:
    """A count that does not grow with s or b (kernels launched): its value at :data:`SHAPE_POINT`, per layer and
    outside."""
    at: dict[int, float] = {}
    for t in traces:
        if (as_int(t.get("s")), as_int(t.get("b"))) == SHAPE_POINT:
            at[as_int(t.get("depth")) or 0] = sum(_num(t[k]) for k in keys)
    if 1 not in at or 2 not in at:
        return Series()
    per = at[2] - at[1]
    return Series((at[1] - per, 0.0, 0.0, 0.0, 0.0), (per, 0.0, 0.0, 0.0, 0.0))


def _num(value: JSON) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def _gemms(traces: list[JSONObject], layers: int) -> tuple[Gemm, ...]:
    """The GEMMs at :data:`SHAPE_POINT`, per layer (depth 2 less depth 1) times ``layers`` plus the rest; a
    dimension that is a multiple of the point's token count becomes that multiple of tokens."""
    tokens = SHAPE_POINT[0] * SHAPE_POINT[1]
    at: dict[int, dict[tuple[int, int, int], float]] = {}
    for t in traces:
        if (as_int(t.get("s")), as_int(t.get("b"))) != SHAPE_POINT:
            continue
        rows = t.get("gemms")
        table: dict[tuple[int, int, int], float] = {}
        for row in rows if isinstance(rows, list) else []:
            if isinstance(row, list) and len(row) == 4:
                m, n, k, c = (int(_num(x)) for x in row)
                dims = tuple(-(d // tokens) if d % tokens == 0 else d for d in (m, n, k))
                key = (dims[0], dims[1], dims[2])
                table[key] = table.get(key, 0.0) + c
        at[as_int(t.get("depth")) or 0] = table
    if 1 not in at or 2 not in at:
        return ()
    out = []
    for key in sorted(set(at[1]) | set(at[2])):
        per = at[2].get(key, 0.0) - at[1].get(key, 0.0)
        rest = at[1].get(key, 0.0) - per
        count = rest + layers * per
        if count > 0:
            out.append(Gemm(key[0], key[1], key[2], count))
    return tuple(out)


def _hooks(answer: JSONObject, layers: int) -> Hooks:
    counts = answer.get("modules")
    if not isinstance(counts, dict):
        return Hooks()
    one, two = counts.get("1"), counts.get("2")
    if not isinstance(one, dict) or not isinstance(two, dict):
        return Hooks()

    def total(key: str) -> int:
        a, b = as_int(one.get(key)) or 0, as_int(two.get(key)) or 0
        return (a - (b - a)) + layers * (b - a)

    return Hooks(total("modules"), total("modules_with_params"), total("param_tensors"), total("trainable_tensors"))


def from_trace(answer: JSONObject, layers: int, why: str, variant: str = "") -> Profile:
    """The profile of a tracer answer (:mod:`ftkit.launch.trace`) for a model of ``layers`` decoder layers."""
    raw = answer.get("traces")
    traces = [t for t in raw if isinstance(t, dict)] if isinstance(raw, list) else []
    if variant:
        traces = [t for t in traces if t.get("variant", "") == variant]
    else:
        traces = [t for t in traces if not t.get("variant")]
    if not traces:
        raise ValueError("the trace has no points")
    peak_f, peak_b = _series(traces, "peak_fwd"), _series(traces, "peak_bwd")
    # the peak is the larger phase; both are fitted, and each coefficient set stands for its own phase
    peak = _MaxSeries.of(peak_f, peak_b)
    grads = max((as_int(t.get("grad_bytes_max")) or 0 for t in traces), default=0)
    launches = _constant(traces, ("ops_fwd", "ops_bwd"))
    return Profile(
        source="traced",
        why=why,
        layers=layers,
        saved=_series(traces, "saved"),
        peak=peak,
        largest_grad_bytes=grads,
        matmul_flops=_series(traces, "matmul_flops"),
        attn_flops=_series(traces, "attn_flops"),
        mem_bytes=_series(traces, "mem_bytes"),
        launches=launches,
        gemms=_gemms(traces, layers),
        hooks=_hooks(answer, layers),
        variant=variant,
    )


@dataclass(frozen=True)
class _MaxSeries(Series):
    """The larger of two series at each (s, b, layers): the forward and the backward peak."""

    other: Series = field(default_factory=Series)

    @staticmethod
    def of(a: Series, b: Series) -> _MaxSeries:
        return _MaxSeries(a.outside, a.per_layer, b)

    def at(self, s: float, b: float, layers: int) -> float:
        return max(Series.at(self, s, b, layers), self.other.at(s, b, layers))

    def layer(self, s: float, b: float) -> float:
        return max(Series.layer(self, s, b), self.other.layer(s, b))


# ------------------------------------------------------------------------------------------------ closed form

_SWIGLU_RMSNORM = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")


def closed_form(
    shape: ModelShape,
    k: int,
    *,
    gradient_checkpointing: bool,
    eager_attention: bool = False,
    lora_inputs: Sequence[int] = (),
    lora_dropout: float = 0.0,
    why: str,
) -> Profile:
    """The profile from formulas (module docstring): ``lora_inputs`` the input width of each adapted module."""
    h, inter, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    hq, hkv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if shape.family in _SWIGLU_RMSNORM:
        per_token = 2 * (4 + k) * h + k * h + 2 * k * hq + 2 * k * hkv + k * h + 4 * k * inter
    else:
        per_token = 34 * h * k // 2
    per_token += sum((k + 1) * x if lora_dropout > 0 else 0 for x in lora_inputs) // max(1, shape.num_layers)
    scores = 6 * shape.num_heads if eager_attention else 0  # per token per s: fp32 softmax + a k-bit copy
    outside_token = (4 + k) * h + k * h + 4 * v  # final norm, LM head input, fp32 log-softmax
    if gradient_checkpointing:
        saved_layer = Series(per_layer=(0.0, 0.0, float(k * h), 0.0, 0.0))
        one_layer = (0.0, 0.0, float(per_token), 0.0, float(scores))
        saved = Series((0.0, 0.0, float(outside_token), 0.0, 0.0), saved_layer.per_layer)
        peak = Series(
            (one_layer[0], 0.0, float(outside_token + LOSS_PEAK_V * v + per_token), 0.0, float(scores)),
            saved_layer.per_layer,
        )
    else:
        saved = Series((0.0, 0.0, float(outside_token), 0.0, 0.0), (0.0, 0.0, float(per_token), 0.0, float(scores)))
        peak = Series((0.0, 0.0, float(outside_token + LOSS_PEAK_V * v), 0.0, 0.0), saved.per_layer)
    # work: 2 FLOPs per multiply-add of every linear layer, 3 passes (6 with the weight gradient: forward, input and
    # weight gradients), a recomputed forward with checkpointing; memory-bound ~4x the saved bytes; launches per layer
    # as traced for a Llama layer (72 forward and backward), 60 outside
    linear = [t for t in shape.tensors if t.kind == "linear" and len(t.shape) == 2]
    per_layer_lin = sum(t.numel for t in linear if ".layers." in t.name or ".h." in t.name) / max(1, shape.num_layers)
    outside_lin = sum(t.numel for t in linear) - per_layer_lin * shape.num_layers
    passes = 8 if gradient_checkpointing else 6
    gemms = tuple(
        g
        for t in linear
        for g in (
            Gemm(-1, t.shape[0], t.shape[1], 1.0),
            Gemm(-1, t.shape[1], t.shape[0], 1.0),
            Gemm(t.shape[0], t.shape[1], -1, 1.0),
        )
    )
    return Profile(
        source="closed form",
        why=why,
        layers=shape.num_layers,
        saved=saved,
        peak=peak,
        largest_grad_bytes=k * shape.largest_tensor_params,
        matmul_flops=Series((0.0, 0.0, passes * outside_lin, 0.0, 0.0), (0.0, 0.0, passes * per_layer_lin, 0.0, 0.0)),
        attn_flops=Series(per_layer=(0.0, 0.0, 0.0, 0.0, 3.5 * 2.0 * hq)),
        mem_bytes=Series(tuple(4 * c for c in saved.outside), tuple(4 * c for c in saved.per_layer)),
        launches=Series((60.0, 0, 0, 0, 0), (72.0 * (1.3 if gradient_checkpointing else 1.0), 0, 0, 0, 0)),
        gemms=gemms,
        hooks=Hooks(
            modules=len({t.module for t in shape.tensors}) * 3 // 2,
            modules_with_params=len({t.module for t in shape.tensors}),
            param_tensors=len(shape.tensors),
            trainable_tensors=len(shape.tensors),
        ),
    )


# ------------------------------------------------------------------------------------------------ trace + cache


@dataclass(frozen=True)
class Request:
    """What a profile depends on (the cache key hashes all of it, with the libraries' versions)."""

    config: JSONObject
    dtype: str  # bf16 | fp32 (fp16 traces as bf16: the same sizes)
    gradient_checkpointing: bool
    lora: JSONObject | None  # r, alpha, dropout, target_modules

    def as_json(self) -> JSONObject:
        variants: list[JSON] = [{"name": "", "zero3_linear": False}]
        if self.lora is not None:  # ZeRO-3's linear keeps the inputs of frozen layers too
            variants.append({"name": "zero3", "zero3_linear": True})
        return {
            "config": self.config,
            "dtype": self.dtype,
            "gradient_checkpointing": self.gradient_checkpointing,
            "lora": self.lora,
            "points": [list(p) for p in POINTS],
            "depths": [1, 2],
            "variants": variants,
            "device": "meta",
        }


def request_for(
    config: Mapping[str, JSON], precision: str, gradient_checkpointing: bool, lora: JSONObject | None
) -> Request:
    return Request(dict(config), "fp32" if precision == "fp32" else "bf16", gradient_checkpointing, lora)


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return ftkit_cache() / "profiles"


def cache_key(req: Request, libs: Mapping[str, str]) -> str:
    blob = json.dumps({"tracer": TRACER_VERSION, "request": req.as_json(), "versions": dict(libs)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _libraries() -> dict[str, str]:
    v = versions(("torch", "transformers", "peft"))
    return {k: v[k] for k in ("torch", "transformers", "peft")}


def run_tracer(req: JSONObject, timeout: float = TRACE_TIMEOUT_S) -> JSONObject:
    """``python -m ftkit.launch.trace`` on ``req``: its answer, or ``{"ok": false, "error": ...}``."""
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "0"}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ftkit.launch.trace"],
            input=json.dumps(req),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "error": f"the tracer did not finish: {type(e).__name__}"}
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("FTKIT_TRACE ")), None)
    if line is None:
        tail = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:200]
        return {"ok": False, "error": f"the tracer gave no answer ({tail})"}
    try:
        answer = json.loads(line.removeprefix("FTKIT_TRACE "))
    except json.JSONDecodeError:
        return {"ok": False, "error": "the tracer's answer is not JSON"}
    return answer if isinstance(answer, dict) else {"ok": False, "error": "the tracer's answer is not an object"}


@dataclass(frozen=True)
class Loaded:
    """The profiles of one request: ``default`` and (LoRA) ``zero3``; ``answer`` None when not traced."""

    default: Profile
    zero3: Profile
    answer: JSONObject | None = None


def load_profile(req: Request, shape: ModelShape, closed: Profile, closed_zero3: Profile | None = None) -> Loaded:
    """The traced profiles of ``req`` from the cache, else from a new trace (then cached), else ``closed`` with the
    reason in its line. ``FTKIT_PROFILE=formula`` never traces."""
    mode = os.environ.get(PROFILE_ENV, "auto")
    z3 = closed_zero3 or closed
    if mode == "formula":
        why = f"{PROFILE_ENV}=formula (tracing off)"
        return Loaded(replace(closed, why=why), replace(z3, why=why))
    libs = _libraries()
    if libs["torch"] == "missing" or libs["transformers"] == "missing":
        why = "torch and transformers are not installed here, so the model cannot be traced"
        return Loaded(replace(closed, why=why), replace(z3, why=why))
    key = cache_key(req, libs)
    path = cache_dir() / f"{key}.json"
    answer: JSONObject | None = None
    cached = False
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("version", TRACER_VERSION) == TRACER_VERSION:
            answer, cached = data, True
    except (OSError, ValueError):
        pass
    if answer is None:
        t0 = time.monotonic()
        answer = run_tracer(req.as_json())
        answer["seconds"] = round(time.monotonic() - t0, 1)
        answer.setdefault("version", TRACER_VERSION)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(answer), fsync=False)
        except OSError:
            pass  # no cache: the next plan traces again
    if not answer.get("ok"):
        why = f"tracing failed ({answer.get('error')}); closed form"
        return Loaded(replace(closed, why=why), replace(z3, why=why), answer)
    libs_s = ", ".join(f"{k} {v}" for k, v in libs.items())
    why = (f"cached ({path})" if cached else f"traced now in {answer.get('seconds')} s, cached in {path}") + (
        f"; {answer.get('model_class')} on the meta device, {libs_s}"
    )
    try:
        default = from_trace(answer, shape.num_layers, why)
        zero3 = from_trace(answer, shape.num_layers, why, "zero3") if req.lora is not None else default
    except (ValueError, KeyError, TypeError) as e:
        why = f"the trace could not be read ({e}); closed form"
        return Loaded(replace(closed, why=why), replace(z3, why=why), answer)
    return Loaded(default, zero3, answer)
