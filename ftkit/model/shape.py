"""Parameter counts and shapes of a model, from its ``config.json`` alone.

The planner needs Ψ (total parameters), the trainable count (all of Ψ, or the LoRA adapters), the hidden size
(bucket sizes: docs/design.md, Rendering rules), the largest layer (ZeRO-3 gathers it whole) and the dimensions that
drive activation memory. Loading weights to learn these would take minutes and many GiB, so:

* ``count_params(cfg)`` enumerates every parameter tensor in closed form for the common decoder families
  (llama, mistral, mixtral, qwen2, qwen3, gemma, gemma2, phi3, gpt2, gpt_neox), with transformers' config-class
  defaults for absent keys. The tensor names and shapes are the ones transformers' ``*ForCausalLM`` registers, so
  the tests can compare them one by one with a model built on the meta device.
* ``count_params_meta(path)`` is the slow path for any other family: it builds the model on PyTorch's meta
  device (nothing allocated) through transformers and reads the same information off the modules.
* ``count_params_any(path)`` picks the first that applies.

This module is part of the import-light controller: torch/transformers are imported only inside
``count_params_meta``.
"""

from __future__ import annotations

import builtins
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ftkit.errors import ModelConfigError, Problem
from ftkit.rundir.records import JSON, JSONObject

# Keys that hold a hidden size in the configs transformers ships (hidden_size: most; n_embd: gpt2 and
# friends; d_model: t5/bart/whisper; embed_dim / dim: some vision towers and older configs).
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "embed_dim", "dim")

SUPPORTED_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox")

# Module kinds recorded per tensor. LoRA can target "linear" (nn.Linear / GPT-2's Conv1D), "embedding",
# "experts" (fused 3-D expert weights, through PEFT's target_parameters) and "router" (a bare 2-D weight).
LINEAR, EMBEDDING, NORM, EXPERTS, ROUTER, OTHER = "linear", "embedding", "norm", "experts", "router", "other"


class TensorSpec(NamedTuple):
    """One parameter tensor as transformers registers it: full dotted name, shape, kind of the owning module."""

    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0] if "." in self.name else ""


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model, without its weights.

    ``total_params`` counts shared (tied) tensors once, like ``sum(p.numel() for p in model.parameters())``.
    ``largest_layer_params`` is DeepSpeed's "largest layer" (``stage3.model_to_params``): the most parameters any
    single module owns directly (``parameters(recurse=False)``) — usually the embedding or, for fused MoE
    experts, one layer's expert block. ZeRO-3 must gather that much at once.
    """

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    total_params: int
    largest_layer_params: int
    largest_tensor_params: int
    num_experts: int = 0  # 0 for dense models
    experts_per_token: int = 0
    source: str = "closed-form"  # "closed-form" | "meta-device"
    tensors: tuple[TensorSpec, ...] = field(default=(), repr=False, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


# --------------------------------------------------------------------------------------------------------------
# config.json


# Decoder layer classes whose names do not follow <Prefix>DecoderLayer (the class FSDP wraps per unit).
_LAYER_CLASS = {
    "GPT2LMHeadModel": "GPT2Block",
    "GPTNeoXForCausalLM": "GPTNeoXLayer",
    "GPTJForCausalLM": "GPTJBlock",
    "BloomForCausalLM": "BloomBlock",
    "MptForCausalLM": "MptBlock",
}
_HEADS = ("ForCausalLM", "LMHeadModel")  # not ForConditionalGeneration: multimodal models wrap several layer kinds


def decoder_layer_class(cfg: Mapping[str, JSON]) -> str | None:
    """The transformers class of one decoder layer, from config.json's ``architectures`` (``LlamaForCausalLM`` ->
    ``LlamaDecoderLayer``); None when the config names no architecture this rule knows."""
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch is None:
        return None
    if arch in _LAYER_CLASS:
        return _LAYER_CLASS[arch]
    for head in _HEADS:
        if arch.endswith(head) and len(arch) > len(head):
            return arch[: -len(head)] + "DecoderLayer"
    return None


def load_model_config(model_path: str) -> JSONObject:
    """Read ``<model_path>/config.json``; a missing or unparsable file is a ModelConfigError naming the path."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        if not os.path.isdir(model_path):
            raise ModelConfigError(Problem(f"model directory not found (looked for {path})", file=path))
        raise ModelConfigError(Problem("config.json not found in the model directory", file=path))
    return load_config_file(path)


def load_config_file(path: str) -> JSONObject:
    """Read a config.json file (a model directory's, the hub cache's or a checked-in copy) into a dict."""
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(Problem(f"cannot read config.json: {exc}", file=path)) from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(Problem(f"not valid JSON: {exc.msg}", file=path, line=exc.lineno)) from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(Problem(f"expected a JSON object, got {type(cfg).__name__}", file=path))
    return cfg


def _sub_configs(cfg: Mapping[str, JSON]) -> Iterable[Mapping[str, JSON]]:
    """Nested configs of multimodal / encoder-decoder models (text_config, vision_config, encoder, ...)."""
    for key, value in cfg.items():
        if isinstance(value, Mapping) and (key.endswith("_config") or key in ("encoder", "decoder")):
            yield value


def hidden_size(cfg: Mapping[str, JSON], source: str | None = None) -> int:
    """The model's hidden size h: the first hidden-size key at each level, max over nested sub-configs.

    Multimodal configs keep the language model's width in ``text_config`` and a smaller one in
    ``vision_config``; bucket sizes must fit the widest tensor that is communicated, hence the max.
    """
    found: list[int] = []

    def visit(c: Mapping[str, JSON]) -> None:
        for key in _HIDDEN_KEYS:
            value = c.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append(value)
                break
        else:
            # A nested config may leave the width at its class default (LLaVA-1.5's text_config has no
            # hidden_size: LlamaConfig's 4096 applies); fall back to that default for the families we know.
            model_type = c.get("model_type", "")
            defaults = _DEFAULTS[model_type] if model_type in _DEFAULTS else {}
            default = defaults.get("hidden_size") or defaults.get("n_embd")
            if default:
                found.append(default)
        for sub in _sub_configs(c):
            visit(sub)

    visit(cfg)
    if not found:
        keys = "/".join(_HIDDEN_KEYS)
        raise ModelConfigError(Problem(f"no hidden size ({keys}) at top level or in a nested *_config", file=source))
    return max(found)


# --------------------------------------------------------------------------------------------------------------
# closed form

# transformers' config-class defaults (transformers 5.x) for the keys the counts depend on. head_dim None means
# "hidden_size // num_attention_heads"; num_key_value_heads None means "= num_attention_heads".
_DEFAULTS: dict[str, dict[str, int | bool | None]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        head_dim=None,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=None,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=None,
        tie_word_embeddings=False,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=None,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    "gemma": dict(
        vocab_size=256000,
        hidden_size=3072,
        intermediate_size=24576,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=256,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "gemma2": dict(
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "phi3": dict(
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        head_dim=None,
        tie_word_embeddings=False,
    ),
    "gpt2": dict(
        vocab_size=50257,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_inner=None,
        tie_word_embeddings=True,
        add_cross_attention=False,
    ),
    "gpt_neox": dict(
        vocab_size=50432,
        hidden_size=6144,
        intermediate_size=24576,
        num_hidden_layers=44,
        num_attention_heads=64,
        tie_word_embeddings=False,
        attention_bias=True,
    ),
}

# GPT-2's config accepts the common names too (its attribute_map); config.json normally uses the n_* ones.
_GPT2_ALIASES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
}


class _Reader:
    """Typed access to a config dict with family defaults; bad values name the key and the file."""

    def __init__(self, cfg: Mapping[str, JSON], family: str, source: str | None):
        self.cfg, self.defaults, self.source = cfg, _DEFAULTS[family], source

    def raw(self, key: str) -> JSON:
        if key in self.cfg:
            return self.cfg[key]
        alias = _GPT2_ALIASES.get(key)
        if alias and alias in self.cfg:
            return self.cfg[alias]
        return self.defaults.get(key)

    def int(self, key: str) -> int:
        value = self.raw(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(Problem(f"{key} must be a positive integer, got {value!r}", file=self.source))
        return value

    def optional_int(self, key: str) -> builtins.int | None:  # builtins: `int` here is the method above
        """:meth:`int`, or None when the key is absent or null."""
        return None if self.raw(key) is None else self.int(key)

    def bool(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise ModelConfigError(Problem(f"{key} must be true or false, got {value!r}", file=self.source))
        return value


def _lin(name: str, n_in: int, n_out: int, bias: bool) -> list[TensorSpec]:
    """nn.Linear(n_in, n_out): weight (out, in) and optional bias (out,)."""
    out = [TensorSpec(f"{name}.weight", (n_out, n_in), LINEAR)]
    if bias:
        out.append(TensorSpec(f"{name}.bias", (n_out,), LINEAR))
    return out


def _conv1d(name: str, n_in: int, n_out: int) -> list[TensorSpec]:
    """GPT-2's Conv1D(n_out, n_in): weight stored transposed (in, out), always a bias."""
    return [TensorSpec(f"{name}.weight", (n_in, n_out), LINEAR), TensorSpec(f"{name}.bias", (n_out,), LINEAR)]


def _norm(name: str, dim: int, bias: bool = False) -> list[TensorSpec]:
    out = [TensorSpec(f"{name}.weight", (dim,), NORM)]
    if bias:
        out.append(TensorSpec(f"{name}.bias", (dim,), NORM))
    return out


@dataclass
class _Dims:
    h: int
    layers: int
    heads: int
    kv: int
    hd: int
    inter: int
    vocab: int
    tied: bool
    experts: int = 0
    topk: int = 0


def _llama_like(family: str, r: _Reader) -> tuple[_Dims, list[TensorSpec]]:
    """llama, mistral, mixtral, qwen2, qwen3, gemma, gemma2, phi3: pre-norm decoder with rotary attention."""
    h, layers = r.int("hidden_size"), r.int("num_hidden_layers")
    heads, inter, vocab = r.int("num_attention_heads"), r.int("intermediate_size"), r.int("vocab_size")
    kv = r.optional_int("num_key_value_heads") or heads
    hd = r.optional_int("head_dim") or h // heads
    tied = r.bool("tie_word_embeddings")
    attn_bias = family in ("llama", "qwen3", "gemma", "gemma2") and r.bool("attention_bias")
    mlp_bias = family == "llama" and r.bool("mlp_bias")
    experts = r.int("num_local_experts") if family == "mixtral" else 0
    topk = r.int("num_experts_per_tok") if family == "mixtral" else 0

    t: list[TensorSpec] = [TensorSpec("model.embed_tokens.weight", (vocab, h), EMBEDDING)]
    for i in range(layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if family == "phi3":
            t += _lin(f"{a}.o_proj", heads * hd, h, False)
            t += _lin(f"{a}.qkv_proj", h, heads * hd + 2 * kv * hd, False)
        else:
            qkv_bias = True if family == "qwen2" else attn_bias  # Qwen2 hard-codes q/k/v biases, o_proj has none
            t += _lin(f"{a}.q_proj", h, heads * hd, qkv_bias)
            t += _lin(f"{a}.k_proj", h, kv * hd, qkv_bias)
            t += _lin(f"{a}.v_proj", h, kv * hd, qkv_bias)
            t += _lin(f"{a}.o_proj", heads * hd, h, attn_bias)
            if family == "qwen3":
                t += _norm(f"{a}.q_norm", hd) + _norm(f"{a}.k_norm", hd)
        m = f"{p}.mlp"
        if family == "mixtral":
            t.append(TensorSpec(f"{m}.gate.weight", (experts, h), ROUTER))
            t.append(TensorSpec(f"{m}.experts.gate_up_proj", (experts, 2 * inter, h), EXPERTS))
            t.append(TensorSpec(f"{m}.experts.down_proj", (experts, h, inter), EXPERTS))
        elif family == "phi3":
            t += _lin(f"{m}.gate_up_proj", h, 2 * inter, False) + _lin(f"{m}.down_proj", inter, h, False)
        else:
            t += _lin(f"{m}.gate_proj", h, inter, mlp_bias) + _lin(f"{m}.up_proj", h, inter, mlp_bias)
            t += _lin(f"{m}.down_proj", inter, h, mlp_bias)
        t += _norm(f"{p}.input_layernorm", h) + _norm(f"{p}.post_attention_layernorm", h)
        if family == "gemma2":
            t += _norm(f"{p}.pre_feedforward_layernorm", h) + _norm(f"{p}.post_feedforward_layernorm", h)
    t += _norm("model.norm", h)
    if not tied:
        t += _lin("lm_head", h, vocab, False)
    return _Dims(h, layers, heads, kv, hd, inter, vocab, tied, experts, topk), t


def _gpt2(r: _Reader) -> tuple[_Dims, list[TensorSpec]] | None:
    if r.raw("add_cross_attention"):
        return None  # cross-attention blocks: leave it to the meta-device path
    h, layers, heads = r.int("n_embd"), r.int("n_layer"), r.int("n_head")
    vocab, positions = r.int("vocab_size"), r.int("n_positions")
    inter = r.optional_int("n_inner") or 4 * h
    tied = r.bool("tie_word_embeddings")
    t = [
        TensorSpec("transformer.wte.weight", (vocab, h), EMBEDDING),
        TensorSpec("transformer.wpe.weight", (positions, h), EMBEDDING),
    ]
    for i in range(layers):
        p = f"transformer.h.{i}"
        t += _norm(f"{p}.ln_1", h, bias=True)
        t += _conv1d(f"{p}.attn.c_attn", h, 3 * h) + _conv1d(f"{p}.attn.c_proj", h, h)
        t += _norm(f"{p}.ln_2", h, bias=True)
        t += _conv1d(f"{p}.mlp.c_fc", h, inter) + _conv1d(f"{p}.mlp.c_proj", inter, h)
    t += _norm("transformer.ln_f", h, bias=True)
    if not tied:
        t += _lin("lm_head", h, vocab, False)
    return _Dims(h, layers, heads, heads, h // heads, inter, vocab, tied), t


def _gpt_neox(r: _Reader) -> tuple[_Dims, list[TensorSpec]]:
    h, layers, heads = r.int("hidden_size"), r.int("num_hidden_layers"), r.int("num_attention_heads")
    inter, vocab, tied = r.int("intermediate_size"), r.int("vocab_size"), r.bool("tie_word_embeddings")
    bias = r.bool("attention_bias")
    t = [TensorSpec("gpt_neox.embed_in.weight", (vocab, h), EMBEDDING)]
    for i in range(layers):
        p = f"gpt_neox.layers.{i}"
        t += _norm(f"{p}.input_layernorm", h, bias=True) + _norm(f"{p}.post_attention_layernorm", h, bias=True)
        t += _lin(f"{p}.attention.query_key_value", h, 3 * h, bias) + _lin(f"{p}.attention.dense", h, h, bias)
        t += _lin(f"{p}.mlp.dense_h_to_4h", h, inter, True) + _lin(f"{p}.mlp.dense_4h_to_h", inter, h, True)
    t += _norm("gpt_neox.final_layer_norm", h, bias=True)
    if not tied:
        t += _lin("lm_head", h, vocab, False)
    return _Dims(h, layers, heads, heads, h // heads, inter, vocab, tied), t


def _largest_layer(tensors: Sequence[TensorSpec]) -> int:
    """DeepSpeed's largest layer: max over modules of the parameters the module owns directly."""
    per_module: dict[str, int] = {}
    for t in tensors:
        per_module[t.module] = per_module.get(t.module, 0) + t.numel
    return max(per_module.values(), default=0)


def _shape(family: str, d: _Dims, tensors: list[TensorSpec], source: str) -> ModelShape:
    return ModelShape(
        family=family,
        hidden_size=d.h,
        num_layers=d.layers,
        num_heads=d.heads,
        num_kv_heads=d.kv,
        head_dim=d.hd,
        intermediate_size=d.inter,
        vocab_size=d.vocab,
        tied_embeddings=d.tied,
        total_params=sum(t.numel for t in tensors),
        largest_layer_params=_largest_layer(tensors),
        largest_tensor_params=max((t.numel for t in tensors), default=0),
        num_experts=d.experts,
        experts_per_token=d.topk,
        source=source,
        tensors=tuple(tensors),
    )


def count_params(cfg: Mapping[str, JSON], source: str | None = None) -> ModelShape | None:
    """Closed-form parameter tensors for the supported families; ``None`` when the family is not one of them.

    ``source`` (the config.json path) only makes error messages name the file.
    """
    family = cfg.get("model_type")
    if family not in _DEFAULTS:
        return None
    r = _Reader(cfg, family, source)
    if family == "gpt2":
        built = _gpt2(r)
        if built is None:
            return None
    elif family == "gpt_neox":
        built = _gpt_neox(r)
    else:
        built = _llama_like(family, r)
    dims, tensors = built
    return _shape(family, dims, tensors, "closed-form")


# --------------------------------------------------------------------------------------------------------------
# slow path: the meta device


def _first_int(cfg: Mapping[str, JSON], *keys: str) -> int:
    for c in [cfg, *_sub_configs(cfg)]:
        for key in keys:
            value = c.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def count_params_meta(model_path: str) -> ModelShape:
    """Build the model on the meta device through transformers and read its parameters (any family).

    Nothing is allocated, so even 70B models take well under a second once transformers is imported; the cost
    is the import (seconds), which is why this is the fallback and lives inside a function.
    """
    path = model_path if os.path.isfile(model_path) else os.path.join(model_path, "config.json")
    cfg = load_config_file(path) if os.path.isfile(model_path) else load_model_config(model_path)
    try:
        import torch
        import transformers
        from transformers import AutoConfig
    except ImportError as exc:  # pragma: no cover - the controller may run without the heavy stack
        raise ModelConfigError(
            Problem(
                f"model_type {cfg.get('model_type')!r} has no closed-form count and transformers is not importable "
                f"({exc})",
                file=path,
            )
        ) from None
    # Causal LMs first (what the training entry builds); multimodal models (LLaVA, ...) are not causal-LM
    # classes in transformers, so try the image-text-to-text head and finally the bare model.
    auto_classes = [
        getattr(transformers, n, None) for n in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel")
    ]
    model, first_error = None, ""
    try:
        hf_cfg = AutoConfig.from_pretrained(os.path.dirname(path) if os.path.basename(path) == "config.json" else path)
    except (ValueError, KeyError, OSError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelConfigError(Problem(f"transformers cannot read this config: {first}", file=path)) from None
    for auto in filter(None, auto_classes):
        try:
            with torch.device("meta"):
                model = auto.from_config(hf_cfg)
            break
        except (ValueError, KeyError, TypeError) as exc:
            first_error = first_error or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if model is None:
        raise ModelConfigError(Problem(f"transformers cannot build this model: {first_error}", file=path))

    kinds: dict[str, str] = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if isinstance(module, torch.nn.Linear) or cls == "Conv1D":
            kinds[name] = LINEAR
        elif isinstance(module, torch.nn.Embedding):
            kinds[name] = EMBEDDING
        elif "norm" in cls.lower():
            kinds[name] = NORM
        else:
            kinds[name] = OTHER
    tensors = []
    for name, p in model.named_parameters():  # shared (tied) parameters come once, as in total_params
        module = name.rsplit(".", 1)[0] if "." in name else ""
        kind = kinds.get(module, OTHER)
        if kind == OTHER and p.dim() == 3:
            kind = EXPERTS
        tensors.append(TensorSpec(name, tuple(p.shape), kind))
    largest = 0
    for module in model.modules():
        largest = max(largest, sum(p.numel() for p in module.parameters(recurse=False)))

    # read dimensions off the loaded config (it carries the class defaults config.json may leave out)
    text = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    full = hf_cfg.to_dict()
    heads = _first_int(full, "num_attention_heads", "n_head")
    h = hidden_size(full, source=path)
    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    tied = bool(out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight)
    return ModelShape(
        family=str(cfg.get("model_type", "unknown")),
        hidden_size=h,
        num_layers=_first_int(full, "num_hidden_layers", "n_layer", "num_layers"),
        num_heads=heads,
        num_kv_heads=_first_int(full, "num_key_value_heads") or heads,
        head_dim=int(getattr(text, "head_dim", 0) or (h // heads if heads else 0)),
        intermediate_size=_first_int(full, "intermediate_size", "n_inner", "ffn_dim") or 4 * h,
        vocab_size=_first_int(full, "vocab_size"),
        tied_embeddings=tied,
        total_params=sum(t.numel for t in tensors),
        largest_layer_params=largest,
        largest_tensor_params=max((t.numel for t in tensors), default=0),
        num_experts=_first_int(full, "num_local_experts", "num_experts", "n_routed_experts"),
        experts_per_token=_first_int(full, "num_experts_per_tok", "moe_topk"),
        source="meta-device",
        tensors=tuple(tensors),
    )


def count_params_any(model_path: str) -> ModelShape:
    """Closed form when the family is known (milliseconds, no torch), else the meta-device path."""
    cfg = load_model_config(model_path)
    shape = count_params(cfg, source=os.path.join(model_path, "config.json"))
    return shape if shape is not None else count_params_meta(model_path)


# --------------------------------------------------------------------------------------------------------------
# LoRA

# PEFT's target_modules="all-linear": every nn.Linear/Conv1D except the output layer.
ALL_LINEAR = "all-linear"
_OUTPUT_LAYER = "lm_head"

# transformers 5 fuses Mixtral's per-expert nn.Linear w1/w3/w2 into 3-D parameters; PEFT keeps accepting the old
# names and maps them (peft.utils.transformers_weight_conversion): w1 + w3 -> experts.gate_up_proj at rank 2r
# (both required, they are one tensor now), w2 -> experts.down_proj at rank r. The fused names themselves are not
# valid target_modules (PEFT: "not found"), so only the old names are offered.
_FUSED_EXPERT_ALIASES: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "mixtral": {
        "w1": ("gate_up_proj", ("w1", "w3")),
        "w3": ("gate_up_proj", ("w1", "w3")),
        "w2": ("down_proj", ("w2",)),
    },
}


def _adaptable_modules(shape: ModelShape) -> dict[str, tuple[str, int, int]]:
    """Module name -> (kind, fan_a, fan_b) for every module target_modules can name, in model order."""
    if not shape.tensors:
        raise ModelConfigError(f"no tensor list for model family {shape.family!r}; cannot count LoRA parameters")
    out: dict[str, tuple[str, int, int]] = {}
    for t in shape.tensors:
        if t.kind in (LINEAR, EMBEDDING, ROUTER) and len(t.shape) == 2 and t.name.endswith(".weight"):
            out[t.module] = (t.kind, t.shape[0], t.shape[1])
    if shape.tied_embeddings and _OUTPUT_LAYER not in out:
        out[_OUTPUT_LAYER] = (LINEAR, shape.vocab_size, shape.hidden_size)  # shares the embedding weight
    return out


def _expert_aliases(shape: ModelShape) -> dict[str, tuple[str, tuple[str, ...]]]:
    if not any(t.kind == EXPERTS for t in shape.tensors):
        return {}
    return _FUSED_EXPERT_ALIASES.get(shape.family, {})


def lora_target_names(shape: ModelShape) -> list[str]:
    """Names accepted in ``target_modules`` for this model (PEFT matches them as dotted-name suffixes)."""
    leaves = {name.rsplit(".", 1)[-1] for name in _adaptable_modules(shape)}
    return sorted(leaves | set(_expert_aliases(shape)) | {ALL_LINEAR})


def lora_tensors(shape_or_cfg: ModelShape | Mapping[str, JSON], r: int, target_modules: Sequence[str]) -> list[int]:
    """Element counts of each LoRA tensor PEFT creates (A and B per adapted matrix), in model order.

    The list (not only the sum) is what ZeRO-3 partitions tensor by tensor. LoRA's count is r·(in + out) per
    adapted matrix whatever its orientation (Linear stores (out, in), GPT-2's Conv1D (in, out); an embedding gets
    A: r×V and B: h×r) and rank·E·(in + out) for fused experts (PEFT's ParamWrapper stacks the E experts' ranks).
    """
    shape = _as_shape(shape_or_cfg)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ModelConfigError(f"LoRA rank r must be a positive integer, got {r!r}")
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if ALL_LINEAR in targets and len(targets) > 1:
        # PEFT only understands "all-linear" as the whole target_modules value; in a list it is a module name
        raise ModelConfigError(f"LoRA target_modules: '{ALL_LINEAR}' must be used alone, got {targets}")
    modules = _adaptable_modules(shape)
    aliases = _expert_aliases(shape)

    if targets == [ALL_LINEAR]:
        # every nn.Linear/Conv1D but the output layer; PEFT adds Mixtral's router and experts by their old names
        chosen = {name for name, (kind, _, _) in modules.items() if kind == LINEAR and name != _OUTPUT_LAYER}
        chosen |= {name for name, (kind, _, _) in modules.items() if kind == ROUTER and aliases}
        expert_names = set(aliases)
    else:
        unknown = [t for t in targets if t not in aliases and not any(_suffix_match(n, t) for n in modules)]
        if unknown:
            raise ModelConfigError(
                f"LoRA target_modules {unknown} not found in {shape.family} "
                f"(valid: {', '.join(lora_target_names(shape))})"
            )
        chosen = {name for name in modules if any(_suffix_match(name, t) for t in targets)}
        expert_names = {t for t in targets if t in aliases}
    fused_rank: dict[str, int] = {}
    for name in sorted(expert_names):
        fused, required = aliases[name]
        missing = [n for n in required if n not in expert_names]
        if missing:
            raise ModelConfigError(
                f"LoRA target_modules: {name} needs {', '.join(missing)} too: in this "
                f"transformers version they are one fused tensor ({fused})"
            )
        fused_rank[fused] = r * len(required)

    out: list[int] = []
    for t in shape.tensors:
        if t.kind == EXPERTS and t.name.rsplit(".", 1)[-1] in fused_rank:
            experts, a, b = t.shape
            rank = fused_rank[t.name.rsplit(".", 1)[-1]]
            out += [rank * experts * b, a * rank * experts]
        elif t.name.endswith(".weight") and t.module in chosen and len(t.shape) == 2:
            kind, a, b = modules[t.module]
            out += [r * a, b * r] if kind == EMBEDDING else [r * b, a * r]
    if _OUTPUT_LAYER in chosen and shape.tied_embeddings:
        out += [r * shape.hidden_size, shape.vocab_size * r]
    return out


def lora_trainable_params(shape_or_cfg: ModelShape | Mapping[str, JSON], r: int, target_modules: Sequence[str]) -> int:
    """Trainable parameters of a LoRA adapter (bias="none"): Σ r·(in + out) over the adapted matrices.

    ``target_modules`` follows PEFT exactly, because the training entry hands it to PEFT unchanged: a name matches
    every module whose dotted name ends with it (GPT-2's ``c_proj`` adapts both the attention and the MLP
    projection); ``"all-linear"`` (alone) adapts every linear layer but the output layer; Mixtral's experts are
    named ``w1``/``w2``/``w3`` as before transformers 5 (see ``_FUSED_EXPERT_ALIASES``). An unknown name is a
    ModelConfigError listing the valid ones.
    """
    return sum(lora_tensors(shape_or_cfg, r, target_modules))


def _suffix_match(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _as_shape(shape_or_cfg: ModelShape | Mapping[str, JSON]) -> ModelShape:
    if isinstance(shape_or_cfg, ModelShape):
        return shape_or_cfg
    shape = count_params(shape_or_cfg)
    if shape is None:
        raise ModelConfigError(
            f"model_type {shape_or_cfg.get('model_type')!r} has no closed-form count; pass the ModelShape from "
            "count_params_any() instead"
        )
    return shape
