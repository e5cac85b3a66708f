"""One forward and backward of the real HF model, counted: ``python -m ftkit.launch.trace`` (a JSON request on stdin,
one line ``FTKIT_TRACE {json}`` last on stdout).

``ftkit plan`` needs what a training step of the model really keeps and does, for any architecture transformers can
build from ``config.json`` (docs/design.md, Memory planning). The planner stays import-light, so it runs this in a
subprocess and caches the answer (:mod:`ftkit.plan.profile`). Here the model is built from its config on PyTorch's
``meta`` device (no weights, no memory) with 1 and 2 decoder layers, and one training step is run at a few tiny
(sequence, batch) points. What is counted, per point:

* **saved**: bytes autograd saves for backward (``saved_tensors_hooks``), each storage once, parameters and buffers
  left out; split by decoder layer (module hooks) and outside the layers (embedding, final norm, LM head, loss);
* **live**: bytes of every tensor an operator creates, as long as it lives (a ``TorchDispatchMode`` with a weak
  reference on each storage): the live bytes once the loss is computed, the peak in forward and in backward (the
  loss's fp32 upcast and cross-entropy temporaries are in these peaks; each parameter's gradient is released as soon
  as it is accumulated, as ZeRO's and FSDP's gradient hooks do);
* **work**: operators that launch a kernel (views excluded), matmul FLOPs with their GEMM shapes, attention FLOPs, and
  the bytes the other operators read and write (memory-bound work).

Attention: on ``meta`` PyTorch's SDPA would take its math path and materialise the s×s scores, which no GPU kernel
does. SDPA calls are therefore routed to the flash-attention kernel's own operator
(``_scaled_dot_product_flash_attention_for_cpu``), which saves what CUDA's flash and memory-efficient kernels save
(q, k, v, the output and a log-sum-exp). A direct measurement on real CPU tensors (``"device": "cpu"``; the tests
compare the two) runs the same code unchanged. Gradient checkpointing runs as HF Trainer asks for it (non-reentrant):
the live bytes then hold the layer inputs and one layer's recomputed working set.

Request: ``{"config": {...config.json...}, "dtype": "bf16"|"fp16"|"fp32", "gradient_checkpointing": bool,
"lora": null | {"r", "alpha", "dropout", "target_modules"}, "points": [[s, b], ...], "depths": [1, 2],
"device": "meta"|"cpu"}``. Answer: ``{"ok": true, "versions", "model_class", "attn_implementation", "modules",
"traces": [{depth, s, b, saved, saved_layers, live_loss, live_fwd_end, peak_fwd, peak_bwd, ops_fwd, ops_bwd,
matmul_flops, attn_flops, mem_bytes, gemms}]}``, or ``{"ok": false, "error": "one line"}``.
"""

from __future__ import annotations

import json
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

from ftkit.cluster.pkgversions import versions
from ftkit.rundir.records import JSON, JSONObject

if TYPE_CHECKING:
    import torch
    from torch import nn

MARK = "FTKIT_TRACE "
VERSION = 1  # of what is counted: part of the cache key (ftkit.plan.profile)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_MATMUL = {"mm", "addmm", "bmm", "baddbmm"}
_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu": 1.0,
    "_scaled_dot_product_flash_attention_for_cpu_backward": 2.5,
}


def _emit(obj: JSONObject) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Counter:
    """Every storage an operator creates while active, as (storage, +bytes) and (storage, -bytes) events in order,
    and the work of each operator. Peaks are read from the events afterwards (:meth:`peak`), so gradients, known
    only once they are accumulated, can be left out."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude  # storages not to count (parameters, buffers)
        self.sizes: dict[int, tuple[int, int]] = {}  # live storage (its address) -> (serial number, bytes)
        self.events: list[tuple[int, int]] = []  # (serial number, +bytes | -bytes): addresses are reused, serials not
        self.ops = 0
        self.matmul_flops = 0.0
        self.attn_flops = 0.0
        self.mem_bytes = 0
        self.gemms: dict[tuple[int, int, int], int] = {}

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = int(st._cdata)
        if key in self.sizes or key in self.exclude:
            return
        n = int(st.nbytes())
        serial = len(self.events)
        self.sizes[key] = (serial, n)
        self.events.append((serial, n))
        weakref.finalize(st, self._free, key)

    def serial(self, t: torch.Tensor) -> int:
        """The serial number of a live tensor's storage (-1: not created while counting)."""
        return self.sizes.get(int(t.untyped_storage()._cdata), (-1, 0))[0]

    def _free(self, key: int) -> None:
        serial, n = self.sizes.pop(key, (-1, 0))
        if n:
            self.events.append((serial, -n))

    def live(self, upto: int, skip: set[int]) -> int:
        return sum(n for key, n in self.events[:upto] if key not in skip)

    def peak(self, start: int, end: int, skip: set[int]) -> int:
        """The most bytes live at once between event ``start`` and ``end``, storages in ``skip`` left out."""
        live = self.live(start, skip)
        best = live
        for key, n in self.events[start:end]:
            if key not in skip:
                live += n
                best = max(best, live)
        return best


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def _dispatch_mode(counter: _Counter) -> object:
    """A TorchDispatchMode that feeds ``counter`` (the class is made here: torch is imported only in this process)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            ins = list(_tensors(args)) + list(_tensors(kwargs or {}))
            outs = list(_tensors(out))
            if func.is_view or not outs:  # a view launches nothing and allocates nothing
                return out
            for t in outs:
                counter.add(t)
            counter.ops += 1
            if name in _MATMUL:
                a, b = ins[-2], ins[-1]
                m, k = int(a.shape[-2]), int(a.shape[-1])
                n = int(b.shape[-1])
                batch = int(a.numel() // (m * k)) if a.dim() > 2 else 1
                counter.matmul_flops += 2.0 * batch * m * n * k
                key = (batch * m, n, k)
                counter.gemms[key] = counter.gemms.get(key, 0) + 1
            elif name in _ATTENTION:
                q, k_ = ins[0], ins[1]
                b_, h, s_q, d = (int(x) for x in q.shape)
                s_k = int(k_.shape[-2])
                counter.attn_flops += _ATTENTION[name] * 4.0 * b_ * h * s_q * s_k * d / 2  # causal: half the scores
            else:
                counter.mem_bytes += sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
            return out

    return Counting()


@contextmanager
def _flash_attention_on(device: str) -> Iterator[None]:
    """SDPA as a GPU runs it (module docstring): the flash kernel's operator, on meta and on CPU alike."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    original = F.scaled_dot_product_attention

    def sdpa(  # type: ignore[no-untyped-def]
        q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if device == "meta" and q.dim() == 4:
            if k.shape[1] != q.shape[1] and not enable_gqa:  # pragma: no cover - HF repeats kv heads itself then
                pass
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
            return out[0]
        return original(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )

    F.scaled_dot_product_attention = sdpa
    # Without a cache and a 2-D mask, transformers looks at the position ids for packed sequences, reading a value
    # (``.item()``), which meta tensors do not have. Fine-tuning batches here are not packed.
    from transformers import masking_utils

    packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    if packed is not None:
        masking_utils.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        if packed is not None:
            masking_utils.find_packed_sequence_indices = packed


def _not_packed(position_ids: object) -> None:
    return None


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the longest ModuleList of identical-looking blocks."""
    from torch import nn

    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best):
            best = list(m)
    return best


def build(request: JSONObject, depth: int) -> nn.Module:
    """The model of the request with ``depth`` decoder layers, on the request's device, in training mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(cast(JSONObject, request["config"]))
    if not isinstance(raw.get("model_type"), str):
        raise ValueError("config.json has no model_type")
    model_type = str(raw.pop("model_type"))
    cfg = AutoConfig.for_model(model_type, **raw)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(cfg, key) and isinstance(getattr(cfg, key), int):
            setattr(cfg, key, depth)
    sub = getattr(cfg, "get_text_config", None)
    text = sub() if callable(sub) else cfg
    if text is not cfg and hasattr(text, "num_hidden_layers"):
        text.num_hidden_layers = depth
    if hasattr(cfg, "layer_types") and isinstance(cfg.layer_types, list):
        cfg.layer_types = cfg.layer_types[:depth]
    cfg.use_cache = False
    dtype = getattr(torch, DTYPES[str(request.get("dtype", "bf16"))])
    with torch.device(str(request.get("device", "meta"))):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    lora = request.get("lora")
    if isinstance(lora, dict):
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(
            r=int(cast(int, lora["r"])),
            lora_alpha=cast(int, lora["alpha"]),
            lora_dropout=float(cast(float, lora["dropout"])),
            target_modules=cast(list[str], lora["target_modules"]),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lcfg)  # type: ignore[assignment]
        # peft keeps the adapters in fp32; DeepSpeed casts every parameter to the training dtype, and FSDP2 computes
        # in it (param_dtype): either way the adapters run in bf16/fp16 on the ranks
        model.to(dtype)
    if request.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if isinstance(lora, dict):
            model.enable_input_require_grads()
    model.train()
    return model


def module_counts(model: nn.Module) -> dict[str, int]:
    """What the engines' hooks are per: modules, modules owning parameters, parameter tensors (trainable too)."""
    mods = list(model.modules())
    params = list(model.parameters())
    return {
        "modules": len(mods),
        "modules_with_params": sum(1 for m in mods if any(True for _ in m.parameters(recurse=False))),
        "param_tensors": len(params),
        "trainable_tensors": sum(1 for p in params if p.requires_grad),
        "params": sum(int(p.numel()) for p in params),
        "trainable_params": sum(int(p.numel()) for p in params if p.requires_grad),
    }


def trace_point(model: nn.Module, s: int, b: int, device: str) -> JSONObject:
    """One training step at sequence ``s`` and batch ``b``, counted (module docstring)."""
    import torch

    exclude = {int(t.untyped_storage()._cdata) for t in [*model.parameters(), *model.buffers()]}
    layers = _decoder_layers(model)
    where = {id(m): i for i, m in enumerate(layers)}
    current: list[int] = []
    handles = []

    def enter(mod: nn.Module, _args: object) -> None:
        current.append(where[id(mod)])

    def leave(_mod: nn.Module, _args: object, _out: object) -> None:
        if current:
            current.pop()

    for m in layers:
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    saved: dict[int, tuple[int, int]] = {}  # storage -> (bytes, layer or -1)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = int(t.untyped_storage()._cdata)
        if key not in exclude and key not in saved:
            saved[key] = (int(t.untyped_storage().nbytes()), current[-1] if current else -1)
        return t

    grads: set[int] = set()
    counter = _Counter(exclude)

    def drop_grad(p: torch.Tensor) -> None:
        if p.grad is not None:
            grads.add(counter.serial(p.grad))
        p.grad = None

    for p in model.parameters():
        if p.requires_grad:  # ZeRO's and FSDP's hooks take each gradient away as soon as it is accumulated
            handles.append(p.register_post_accumulate_grad_hook(drop_grad))
    mode = _dispatch_mode(counter)
    try:
        with mode, _flash_attention_on(device):  # type: ignore[attr-defined]
            ids = torch.zeros((b, s), dtype=torch.long, device=device)
            if device != "meta":
                ids = torch.randint(0, 100, (b, s), device=device)
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                out = model(input_ids=ids, labels=ids)
            loss = out.loss
            at_loss = len(counter.events)
            work_fwd = (counter.ops, counter.matmul_flops, counter.attn_flops, counter.mem_bytes)
            del out  # HF Trainer keeps the loss only
            fwd_end = len(counter.events)
            loss.backward()
            del loss
            end = len(counter.events)
    finally:
        for h in handles:
            h.remove()
    per_layer = [0] * len(layers)
    outside = 0
    for nbytes, layer in saved.values():
        if layer < 0:
            outside += nbytes
        else:
            per_layer[layer] += nbytes
    return {
        "s": s,
        "b": b,
        "saved": sum(per_layer) + outside,
        "saved_layers": cast(list[JSON], per_layer),
        "live_loss": counter.live(at_loss, grads),
        "live_fwd_end": counter.live(fwd_end, grads),
        "peak_fwd": counter.peak(0, at_loss, grads),
        "peak_bwd": counter.peak(fwd_end, end, grads),
        "grad_bytes_max": max((counter_size for counter_size in _grad_sizes(counter, grads)), default=0),
        "ops_fwd": work_fwd[0],
        "ops_bwd": counter.ops - work_fwd[0],
        "matmul_flops": counter.matmul_flops,
        "attn_flops": counter.attn_flops,
        "mem_bytes": counter.mem_bytes,
        "gemms": cast(list[JSON], [[m, n, k, c] for (m, n, k), c in sorted(counter.gemms.items())]),
    }


def _grad_sizes(counter: _Counter, grads: set[int]) -> list[int]:
    return [n for key, n in counter.events if key in grads and n > 0]


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


@contextmanager
def _zero3_linear(on: bool) -> Iterator[None]:
    """DeepSpeed ZeRO-3 replaces ``torch.nn.functional.linear`` (``zero_optimization.memory_efficient_linear``, on by
    default) with an autograd function that saves every input, also of a frozen layer's (LoRA's base weights)."""
    if not on:
        yield
        return
    import torch
    import torch.nn.functional as F  # noqa: N812

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, bias=None):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(x, w, bias)
            out = x.matmul(w.t())
            return out + bias if bias is not None else out

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
            x, w, bias = ctx.saved_tensors
            gx = grad.matmul(w) if ctx.needs_input_grad[0] else None
            gw = (
                grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
                if ctx.needs_input_grad[1]
                else None
            )
            gb = grad.reshape(-1, grad.shape[-1]).sum(0) if bias is not None and ctx.needs_input_grad[2] else None
            return gx, gw, gb

    original = F.linear

    def linear(x, w, bias=None):  # type: ignore[no-untyped-def]
        return Linear.apply(x, w, bias)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original


def trace(request: JSONObject) -> JSONObject:
    """Every variant, depth and point of the request (module docstring)."""
    import warnings

    import transformers

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    device = str(request.get("device", "meta"))
    points = cast(list[list[int]], request.get("points") or [[32, 1], [64, 1], [96, 1], [32, 2], [64, 2]])
    depths = cast(list[int], request.get("depths") or [1, 2])
    variants = cast(list[JSONObject], request.get("variants") or [{"name": "", "zero3_linear": False}])
    traces: list[JSON] = []
    counts: dict[str, JSON] = {}
    model_class = attn = ""
    for depth in depths:
        model = build(request, depth)
        model_class = type(model).__name__
        cfg = getattr(model, "config", None)
        attn = str(getattr(cfg, "_attn_implementation", "") or "")
        counts[str(depth)] = cast(JSON, module_counts(model))
        for v in variants:
            with _zero3_linear(bool(v.get("zero3_linear"))):
                for s, b in points:
                    t = trace_point(model, int(s), int(b), device)
                    t["depth"] = depth
                    t["variant"] = str(v.get("name") or "")
                    traces.append(t)
        del model
    return {
        "ok": True,
        "version": VERSION,
        "versions": cast(JSON, versions(("torch", "transformers", "peft"))),
        "model_class": model_class,
        "attn_implementation": attn,
        "modules": counts,
        "traces": traces,
    }


def main(read: Callable[[], str] = sys.stdin.read) -> int:
    try:
        request = json.loads(read())
        if not isinstance(request, dict):
            raise ValueError("the request is not a JSON object")
        _emit(trace(request))
    except Exception as e:  # noqa: BLE001 - one line back to the planner, which falls back to its closed form
        first = (str(e).strip().splitlines() or [""])[0][:300]
        _emit({"ok": False, "error": f"{type(e).__name__}: {first}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
