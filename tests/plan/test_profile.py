"""The model profile (ftkit.plan.profile): the fit of the traced points, what the recorded trace of a Llama says, the
closed form beside it, and the cache: a trace is paid once per model, versions and setting; a failure falls back to
the closed form with a line saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftkit.model.shape import count_params
from ftkit.plan import profile
from ftkit.plan.profile import POINTS, Profile, Request, closed_form, fit, from_trace, load_profile

DATA = Path(__file__).parent / "data"
TRACES = json.loads((DATA / "trace-llama-0.27b.json").read_text())
CFG = TRACES["config"]
H, INTER, V, HEADS = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"], CFG["num_attention_heads"]
SHAPE = count_params(CFG)
assert SHAPE is not None


def test_the_fit_recovers_every_coefficient_from_the_traced_points() -> None:
    c = (7.0, 256.0, 47176.0, 3.0, 96.0)  # 1, s, s*b, s^2, s^2*b
    values = [c[0] + c[1] * s + c[2] * s * b + c[3] * s * s + c[4] * s * s * b for s, b in POINTS]
    assert fit(POINTS, values) == pytest.approx(c, rel=1e-6)


def test_a_traced_llama_layer_saves_24h_plus_8i_bytes_per_token_and_the_loss_peaks_12v() -> None:
    """SDPA in bf16: two RMSNorms (fp32 upcast + bf16 output: 6h each), q/k/v's input, q, k, v, the attention output
    (2h each), the MLP's input (2h), SwiGLU's four I-sized tensors (8I), plus the log-sum-exp (4 bytes per head) and the
    norms' fp32 rsqrt; the loss keeps its fp32 log-softmax (4V) and peaks 8V higher in backward."""
    p = from_trace(TRACES["full"]["answer"], SHAPE.num_layers, "recorded")
    assert p.saved.per_layer == pytest.approx((0, 0, 24 * H + 8 * INTER + 4 * HEADS + 8, 0, 0), abs=1e-6)
    s, b = 1024, 8
    extra = p.peak_bytes(s, b) - p.activation_bytes(s, b)
    assert extra == pytest.approx(8 * s * b * V, rel=0.01)
    assert p.saved.outside[2] == pytest.approx(
        4 * V + 8 * H, rel=1e-3
    )  # log-softmax, final norm, LM head input, labels
    assert p.hooks.trainable_tensors == len(SHAPE.tensors) == p.hooks.modules_with_params


def test_the_closed_form_agrees_with_the_trace_for_a_llama() -> None:
    traced = from_trace(TRACES["full"]["answer"], SHAPE.num_layers, "recorded")
    closed = closed_form(SHAPE, 2, gradient_checkpointing=False, why="test")
    for s, b in ((1024, 8), (4096, 1)):
        assert closed.activation_bytes(s, b) == pytest.approx(traced.activation_bytes(s, b), rel=0.01)
        assert closed.peak_bytes(s, b) == pytest.approx(traced.peak_bytes(s, b), rel=0.01)


def test_lora_under_zero3_keeps_the_inputs_of_frozen_layers() -> None:
    """DeepSpeed ZeRO-3's linear saves every input: the frozen MLP's and attention's too (measured on the H200: LoRA
    ZeRO-3's allocator peak was 10.83 GiB, 1.4 GiB above what PyTorch's own linear keeps)."""
    answer = TRACES["lora"]["answer"]
    plain = from_trace(answer, SHAPE.num_layers, "x")
    zero3 = from_trace(answer, SHAPE.num_layers, "x", "zero3")
    extra = (zero3.saved.per_layer[2] - plain.saved.per_layer[2]) / H
    assert 8 < extra < 14, extra  # q/k/v and o inputs, gate/up input, down input (2I = 5.5h)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FTKIT_PROFILE", "auto")
    monkeypatch.setenv("FTKIT_PROFILE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _closed() -> Profile:
    return closed_form(SHAPE, 2, gradient_checkpointing=False, why="")


def test_a_model_is_traced_once_then_read_from_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def tracer(req, timeout=0):  # noqa: ANN001, ANN202, ARG001
        calls.append(req)
        return json.loads(json.dumps(TRACES["full"]["answer"]))

    monkeypatch.setattr(profile, "run_tracer", tracer)
    req = Request(CFG, "bf16", False, None)
    first = load_profile(req, SHAPE, _closed())
    assert first.default.source == "traced" and "traced now" in first.default.why and len(calls) == 1
    again = load_profile(req, SHAPE, _closed())
    assert again.default.source == "traced" and again.default.why.startswith("cached") and len(calls) == 1
    assert again.default.activation_bytes(1024, 8) == first.default.activation_bytes(1024, 8)
    load_profile(Request(CFG, "bf16", True, None), SHAPE, _closed())  # checkpointing: another profile
    assert len(calls) == 2


def test_a_failed_trace_falls_back_to_the_closed_form_and_says_why(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(profile, "run_tracer", lambda req, timeout=0: {"ok": False, "error": "RuntimeError: no meta"})
    got = load_profile(Request(CFG, "bf16", False, None), SHAPE, _closed())
    assert got.default.source == "closed form"
    assert got.default.line() == "activations closed form: tracing failed (RuntimeError: no meta); closed form"


def test_formula_mode_never_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTKIT_PROFILE", "formula")
    monkeypatch.setattr(profile, "run_tracer", lambda *a, **k: pytest.fail("traced"))
    got = load_profile(Request(CFG, "bf16", False, None), SHAPE, _closed())
    assert got.default.source == "closed form" and "FTKIT_PROFILE=formula" in got.default.why


def test_the_cache_key_holds_the_libraries_versions() -> None:
    req = Request(CFG, "bf16", False, None)
    a = profile.cache_key(req, {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2"})
    b = profile.cache_key(req, {"torch": "2.13.0", "transformers": "5.25.0", "peft": "0.21.2"})
    c = profile.cache_key(
        Request(CFG, "fp32", False, None), {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2"}
    )
    assert len({a, b, c}) == 3


def test_a_plan_is_built_from_its_inputs_without_io(write_recipe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything is gathered once at the edge (ftkit.plan.inputs.gather); plan_from opens, lists, stats, spawns and
    reads the environment nothing (``backend: auto`` picks its candidate first and builds once)."""
    import builtins
    import os
    import subprocess

    from ftkit.plan.inputs import gather
    from ftkit.plan.plan import plan_from
    from ftkit.recipe.load import load_recipe

    recipe = load_recipe(str(write_recipe()), ["train.backend=auto", "zero.stage=auto"])
    inputs = gather(recipe)

    def no_io(*a: object, **k: object) -> None:
        raise AssertionError(f"I/O while planning: {a}")

    for mod, name in ((builtins, "open"), (os, "stat"), (os, "lstat"), (os, "listdir"), (os, "scandir")):
        monkeypatch.setattr(mod, name, no_io)
    monkeypatch.setattr(subprocess, "Popen", no_io)
    monkeypatch.setattr(os, "environ", {})
    plan = plan_from(inputs)
    assert plan.recipe.train.backend in ("deepspeed", "fsdp2") and plan.memory is not None or plan.backend_report


def test_the_planner_has_no_import_loop_even_in_type_hints() -> None:
    import grimp

    graph = grimp.build_graph("ftkit", exclude_type_checking_imports=False, cache_dir=None)
    modules = {m for m in graph.modules if m.startswith("ftkit.plan.")}
    for m in sorted(modules):
        for other in sorted(graph.find_modules_directly_imported_by(m) & modules):
            assert not graph.chain_exists(importer=other, imported=m), f"{m} <-> {other}"
