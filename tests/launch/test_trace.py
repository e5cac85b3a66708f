"""The tracer (``python -m ftkit.launch.trace``, :mod:`ftkit.launch.trace`) against direct measurements.

The planner's activation coefficients come from one training step of the real HF model built on the meta device at
tiny (s, b), with 1 and 2 layers. Here, for tiny Llama, Qwen2, Mistral, Gemma and GPT-2 configs of 3 layers (full
fine-tuning, LoRA, gradient checkpointing), the coefficients are checked against a direct measurement on real CPU
tensors of the 3-layer model at another (s, b): the bytes autograd saves and the live peak, within 5%. The recorded
answers the accuracy tests plan from (tests/plan/data/trace-llama-0.27b.json) are traced again and must still hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftkit.launch import trace
from ftkit.plan import profile

pytestmark = pytest.mark.heavy

TINY = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
    },
    "gemma": {
        "model_type": "gemma",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 512,
    },
    # no attention dropout: on CPU, SDPA with dropout takes the math kernel (s x s scores) where a GPU's flash kernel
    # drops out itself; the tracer counts the GPU's way, the direct measurement runs on CPU
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 512, "attn_pdrop": 0.0},
}
LAYERS = 3
SECOND = (160, 3)  # the direct measurement's (s, b): none of the traced points
LORA = {"r": 4, "alpha": 8, "dropout": 0.05}
TARGETS = {"gpt2": ["c_attn"]}


def _config(family: str) -> dict:
    cfg = dict(TINY[family])
    cfg["n_layer" if family == "gpt2" else "num_hidden_layers"] = LAYERS
    return cfg


def _direct(req: dict, s: int, b: int) -> dict:
    """The real model (all its layers) on CPU tensors at (s, b): what it saves and its live peak."""
    out = trace.trace({**req, "device": "cpu", "points": [[s, b]], "depths": [LAYERS]})
    return out["traces"][0]


@pytest.mark.parametrize(
    "family,kind", [(f, "full") for f in sorted(TINY)] + [("llama", "lora"), ("llama", "checkpointing")]
)
def test_traced_coefficients_match_a_direct_measurement_at_another_point(family: str, kind: str) -> None:
    cfg = _config(family)
    lora = {**LORA, "target_modules": TARGETS.get(family, ["q_proj", "v_proj"])} if kind == "lora" else None
    req = profile.request_for(cfg, "bf16", kind == "checkpointing", lora).as_json()
    answer = trace.trace(req)
    assert answer["ok"] and answer["attn_implementation"] == "sdpa", answer.get("error")
    prof = profile.from_trace(answer, LAYERS, "test")
    s, b = SECOND
    direct = _direct(req, s, b)
    if kind != "checkpointing":  # checkpointing keeps the layers' inputs outside autograd's saved tensors
        assert abs(prof.saved.at(s, b, LAYERS) - direct["saved"]) <= 0.05 * direct["saved"], (prof.saved, direct)
    peak = max(direct["peak_fwd"], direct["peak_bwd"])
    assert abs(prof.peak.at(s, b, LAYERS) - peak) <= 0.05 * peak, (prof.peak.at(s, b, LAYERS), peak)


def test_the_coefficients_separate_what_grows_with_s_squared() -> None:
    """Eager attention materialises the s x s scores: the traced profile has an s^2 b term, SDPA's has none."""
    cfg = {**_config("llama"), "_attn_implementation": "eager", "attn_implementation": "eager"}
    eager = profile.from_trace(trace.trace(profile.request_for(cfg, "bf16", False, None).as_json()), LAYERS, "t")
    sdpa = profile.from_trace(
        trace.trace(profile.request_for(_config("llama"), "bf16", False, None).as_json()), LAYERS, "t"
    )
    assert sdpa.saved.per_layer[3:] == (0.0, 0.0)
    assert eager.saved.per_layer[4] > 0


def test_the_recorded_answers_of_the_accuracy_tests_still_hold() -> None:
    data = json.loads((Path(__file__).parent.parent / "plan" / "data" / "trace-llama-0.27b.json").read_text())
    for name in ("full", "lora"):
        recorded = profile.from_trace(data[name]["answer"], 16, "recorded")
        now = profile.from_trace(trace.trace(data[name]["request"]), 16, "now")
        for s, b in ((1024, 8), (4096, 1)):
            for series in ("saved", "peak", "matmul_flops", "mem_bytes", "launches"):
                a, c = getattr(recorded, series).at(s, b, 16), getattr(now, series).at(s, b, 16)
                assert abs(a - c) <= 0.01 * max(abs(a), 1.0), (name, series, a, c)
        assert recorded.hooks == now.hooks


def test_the_tracer_versions_agree() -> None:
    assert trace.VERSION == profile.TRACER_VERSION
