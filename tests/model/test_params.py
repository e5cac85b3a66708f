"""Parameter counting: the closed form must equal what transformers builds, tensor by tensor.

Every published config under fixtures/model_configs/ and a set of scaled-down variants (odd sizes, biases on,
tied/untied, explicit head_dim, GQA) is counted twice: in closed form (no torch) and by building the model on the
meta device through transformers (``count_params_meta``). Names, shapes, totals, DeepSpeed's "largest layer" and
tying must agree exactly. LoRA counts are checked against PEFT's own ``get_peft_model`` on a meta model.
Nothing is allocated on the meta device, so even the 140B Mixtral takes a fraction of a second.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.errors import ModelConfigError
from ftkit.model.shape import (
    ModelShape,
    count_params,
    count_params_any,
    count_params_meta,
    hidden_size,
    load_model_config,
    lora_target_names,
    lora_tensors,
    lora_trainable_params,
)
from tests.helpers.paths import MODEL_CONFIGS

PUBLISHED = sorted(p.stem for p in MODEL_CONFIGS.glob("*.json") if p.stem != "llava-1.5-7b-hf")

# Scaled-down variants: they exercise options the published configs leave off (biases, tying, head_dim that is
# not hidden/heads, odd widths) and keep the meta builds and PEFT runs tiny.
TINY: dict[str, dict] = {
    "llama-tiny-biases-tied": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=301,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
    "llama-tiny-headdim": dict(
        model_type="llama",
        hidden_size=48,
        intermediate_size=100,
        num_hidden_layers=3,
        num_attention_heads=3,
        head_dim=20,
        vocab_size=97,
    ),
    "mistral-tiny": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
    ),
    "mixtral-tiny": dict(
        model_type="mixtral",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "mixtral-tiny-tied": dict(
        model_type="mixtral",
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=77,
        num_local_experts=3,
        num_experts_per_tok=1,
        tie_word_embeddings=True,
    ),
    "qwen2-tiny-tied": dict(
        model_type="qwen2",
        hidden_size=56,
        intermediate_size=150,
        num_hidden_layers=2,
        num_attention_heads=7,
        num_key_value_heads=1,
        vocab_size=211,
        tie_word_embeddings=True,
    ),
    "qwen3-tiny-bias": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=199,
        attention_bias=True,
    ),
    "gemma-tiny": dict(
        model_type="gemma",
        hidden_size=64,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=128,
        attention_bias=True,
    ),
    "gemma2-tiny": dict(
        model_type="gemma2",
        hidden_size=48,
        intermediate_size=120,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=101,
    ),
    "phi3-tiny": dict(
        model_type="phi3",
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=150,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    ),
    "gpt2-tiny-untied": dict(
        model_type="gpt2",
        n_embd=48,
        n_layer=2,
        n_head=4,
        n_inner=100,
        n_positions=64,
        vocab_size=211,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "gpt_neox-tiny": dict(
        model_type="gpt_neox",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=130,
        attention_bias=False,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    ),
}

# Family defaults: a config with nothing but model_type (and token ids inside the default vocabulary) must count
# like transformers' config class defaults.
DEFAULTS_ONLY = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox"]


def _published(name: str) -> dict:
    return json.loads((MODEL_CONFIGS / f"{name}.json").read_text())


def _model_dir(tmp_path: Path, cfg: dict) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _assert_same(closed: ModelShape, meta: ModelShape) -> None:
    closed_tensors = {t.name: t.shape for t in closed.tensors}
    meta_tensors = {t.name: t.shape for t in meta.tensors}
    assert closed_tensors == meta_tensors
    assert closed.total_params == meta.total_params
    assert closed.largest_layer_params == meta.largest_layer_params
    assert closed.largest_tensor_params == meta.largest_tensor_params
    assert closed.tied_embeddings == meta.tied_embeddings
    assert closed.hidden_size == meta.hidden_size
    assert closed.num_experts == meta.num_experts


# ---------------------------------------------------------------------------------------------------- import


def test_params_and_memory_do_not_import_the_heavy_stack():
    code = (
        "import sys, ftkit.model.shape, ftkit.plan.memory; "
        "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'peft', 'accelerate') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------- closed form


@pytest.mark.heavy
@pytest.mark.parametrize("name", PUBLISHED)
def test_closed_form_equals_meta_device_published(name, tmp_path):
    cfg = _published(name)
    closed = count_params(cfg)
    assert closed is not None and closed.source == "closed-form"
    _assert_same(closed, count_params_meta(_model_dir(tmp_path, cfg)))


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(TINY))
def test_closed_form_equals_meta_device_tiny(name, tmp_path):
    cfg = TINY[name]
    closed = count_params(cfg)
    assert closed is not None
    _assert_same(closed, count_params_meta(_model_dir(tmp_path, cfg)))


@pytest.mark.heavy
@pytest.mark.parametrize("family", DEFAULTS_ONLY)
def test_absent_keys_take_transformers_defaults(family, tmp_path):
    cfg = {"model_type": family}
    closed = count_params(cfg)
    assert closed is not None
    _assert_same(closed, count_params_meta(_model_dir(tmp_path, cfg)))


@pytest.mark.parametrize(
    "name,expected",
    [
        # published parameter counts (model cards / HF hub "safetensors" totals)
        ("Meta-Llama-3-8B", 8_030_261_248),
        ("Llama-2-7b-hf", 6_738_415_616),
        ("Mistral-7B-v0.1", 7_241_732_096),
        ("Mixtral-8x7B-v0.1", 46_702_792_704),
        ("Qwen2-7B", 7_615_616_512),
        ("gemma-7b", 8_537_680_896),
        ("Phi-3-mini-4k-instruct", 3_821_079_552),
        ("gpt2", 124_439_808),
        ("pythia-1b", 1_011_781_632),
    ],
)
def test_published_totals(name, expected):
    assert count_params(_published(name)).total_params == expected


def test_shape_fields_of_a_moe_model():
    shape = count_params(_published("Mixtral-8x7B-v0.1"))
    assert (shape.family, shape.num_experts, shape.experts_per_token, shape.is_moe) == ("mixtral", 8, 2, True)
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (
        4096,
        32,
        32,
        8,
        128,
    )
    # one layer's fused experts (8 × 3 × 4096 × 14336) outweigh the embedding: that is what ZeRO-3 gathers
    assert shape.largest_layer_params == 8 * 3 * 4096 * 14336
    assert shape.largest_tensor_params == 8 * 2 * 14336 * 4096


def test_tied_embeddings_are_counted_once():
    tied = count_params(_published("Qwen2-0.5B"))
    untied = count_params({**_published("Qwen2-0.5B"), "tie_word_embeddings": False})
    assert tied.tied_embeddings and not untied.tied_embeddings
    assert untied.total_params - tied.total_params == 151936 * 896


def test_unknown_family_has_no_closed_form():
    assert count_params({"model_type": "falcon", "hidden_size": 64}) is None
    assert count_params({"hidden_size": 64}) is None
    assert count_params({**TINY["gpt2-tiny-untied"], "add_cross_attention": True}) is None


@pytest.mark.heavy
def test_count_params_any_uses_the_meta_device_for_other_families(tmp_path):
    cfg = dict(
        model_type="starcoder2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        bos_token_id=0,
        eos_token_id=0,
    )
    shape = count_params_any(_model_dir(tmp_path, cfg))
    assert shape.source == "meta-device" and shape.family == "starcoder2"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.hidden_size == 64 and shape.num_layers == 2


def test_count_params_any_prefers_the_closed_form(tmp_path, monkeypatch):
    import ftkit.model.shape as params

    def boom(path):
        raise AssertionError("slow path used for a known family")

    monkeypatch.setattr(params, "count_params_meta", boom)
    assert count_params_any(_model_dir(tmp_path, _published("gpt2"))).total_params == 124_439_808


@pytest.mark.heavy
def test_multimodal_slow_path(tmp_path):
    shape = count_params_any(_model_dir(tmp_path, _published("llava-1.5-7b-hf")))
    assert shape.source == "meta-device"
    assert shape.hidden_size == 4096
    assert shape.total_params == 7_063_427_072


def test_bad_value_names_key_and_file(tmp_path):
    path = _model_dir(tmp_path, {"model_type": "llama", "hidden_size": "big"})
    with pytest.raises(ModelConfigError) as err:
        count_params_any(path)
    message = str(err.value)
    assert "hidden_size" in message and "config.json" in message and "\n" not in message


# ----------------------------------------------------------------------------------------------- config.json


def test_load_model_config_missing_dir(tmp_path):
    with pytest.raises(ModelConfigError) as err:
        load_model_config(str(tmp_path / "nope"))
    assert str(tmp_path / "nope" / "config.json") in str(err.value)
    assert "\n" not in str(err.value)


def test_load_model_config_missing_file(tmp_path):
    with pytest.raises(ModelConfigError) as err:
        load_model_config(str(tmp_path))
    assert str(tmp_path / "config.json") in str(err.value)


def test_load_model_config_bad_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": }')
    with pytest.raises(ModelConfigError) as err:
        load_model_config(str(tmp_path))
    message = str(err.value)
    assert f"{tmp_path / 'config.json'}:2" in message and "not valid JSON" in message and "\n" not in message


def test_load_model_config_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="expected a JSON object"):
        load_model_config(str(tmp_path))


# ------------------------------------------------------------------------------------------------ hidden size


@pytest.mark.parametrize(
    "cfg,expected",
    [
        ({"hidden_size": 4096}, 4096),
        ({"n_embd": 768}, 768),
        ({"d_model": 512}, 512),
        ({"text_config": {"hidden_size": 3584}, "vision_config": {"hidden_size": 1280}}, 3584),
        ({"hidden_size": 1024, "text_config": {"hidden_size": 5120}}, 5120),
        ({"text_config": {"model_type": "llama"}, "vision_config": {"hidden_size": 1024}}, 4096),
    ],
)
def test_hidden_size(cfg, expected):
    assert hidden_size(cfg) == expected


def test_hidden_size_of_published_configs():
    assert hidden_size(_published("gpt2-medium")) == 1024
    assert hidden_size(_published("llava-1.5-7b-hf")) == 4096  # text_config leaves LlamaConfig's default


def test_hidden_size_missing():
    with pytest.raises(ModelConfigError, match="no hidden size"):
        hidden_size({"vision_config": {"image_size": 224}}, source="models/x/config.json")


# ------------------------------------------------------------------------------------------------------ LoRA


def _peft_tensors(cfg: dict, r: int, targets: list[str]) -> list[int]:
    """Sizes of the trainable tensors PEFT itself creates on a meta-device model for the same target_modules."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    modules = "all-linear" if targets == ["all-linear"] else targets
    peft_model = get_peft_model(model, LoraConfig(r=r, target_modules=modules))
    return sorted(p.numel() for p in peft_model.parameters() if p.requires_grad)


LORA_TINY = [
    ("llama-tiny-biases-tied", ["q_proj", "v_proj"]),
    ("llama-tiny-biases-tied", ["all-linear"]),
    ("llama-tiny-headdim", ["o_proj", "down_proj", "lm_head", "embed_tokens"]),
    ("mistral-tiny", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("mixtral-tiny", ["q_proj", "v_proj", "w1", "w3", "w2"]),  # experts by their pre-v5 names, as PEFT takes them
    ("mixtral-tiny", ["w2"]),
    ("mixtral-tiny-tied", ["all-linear"]),
    ("mixtral-tiny-tied", ["gate", "lm_head", "o_proj"]),
    ("qwen2-tiny-tied", ["q_proj", "k_proj", "lm_head"]),
    ("qwen3-tiny-bias", ["all-linear"]),
    ("gemma-tiny", ["q_proj", "v_proj", "embed_tokens"]),
    ("gemma2-tiny", ["gate_proj", "up_proj"]),
    ("phi3-tiny", ["qkv_proj", "gate_up_proj"]),
    ("phi3-tiny", ["all-linear"]),
    ("gpt2-tiny-untied", ["c_attn", "c_proj"]),  # c_proj: both attn.c_proj and mlp.c_proj (suffix match)
    ("gpt2-tiny-untied", ["all-linear"]),
    ("gpt2-tiny-untied", ["c_fc", "wte", "lm_head"]),
    ("gpt_neox-tiny", ["query_key_value", "dense"]),
    ("gpt_neox-tiny", ["dense_h_to_4h", "dense_4h_to_h", "lm_head"]),
]


@pytest.mark.heavy
@pytest.mark.parametrize("name,targets", LORA_TINY, ids=[f"{n}-{'+'.join(t)}" for n, t in LORA_TINY])
def test_lora_equals_peft_tiny(name, targets):
    cfg = TINY[name]
    shape = count_params(cfg)
    r = 7  # odd on purpose
    expected = _peft_tensors(cfg, r, targets)
    assert sorted(lora_tensors(shape, r, targets)) == expected  # tensor by tensor: ZeRO-3 partitions each one
    assert lora_trainable_params(shape, r, targets) == sum(expected)


# one published size per family; PEFT wraps every targeted module in Python, so the big ones cost ~1 s each
# and sit in the heavy tier (the tiny variants above cover the same code paths in the default tier)
_heavy = pytest.mark.heavy
LORA_REAL = [
    ("Meta-Llama-3-8B", ["q_proj", "v_proj"]),
    pytest.param("Mistral-Nemo-Base-2407", ["q_proj", "o_proj"], marks=_heavy),
    pytest.param("Mixtral-8x7B-v0.1", ["q_proj", "w1", "w2", "w3"], marks=_heavy),
    pytest.param("Qwen2-0.5B", ["k_proj", "up_proj"], marks=_heavy),
    pytest.param("Qwen3-0.6B", ["q_proj", "v_proj"], marks=_heavy),
    pytest.param("gemma-2b", ["q_proj", "v_proj"], marks=_heavy),
    pytest.param("gemma-2-2b", ["o_proj"], marks=_heavy),
    pytest.param("Phi-3-mini-4k-instruct", ["qkv_proj"], marks=_heavy),
    ("gpt2", ["c_attn", "c_proj", "c_fc"]),
    ("pythia-160m", ["query_key_value"]),
]


@pytest.mark.heavy
@pytest.mark.parametrize("name,targets", LORA_REAL)
def test_lora_equals_peft_published(name, targets):
    cfg = _published(name)
    shape = count_params(cfg)
    assert lora_trainable_params(shape, 16, targets) == sum(_peft_tensors(cfg, 16, targets))


def test_lora_closed_form_by_hand():
    # Llama-3-8B, r=16 on q and v: 32 layers × 16 × ((4096 + 4096) + (4096 + 1024))
    shape = count_params(_published("Meta-Llama-3-8B"))
    assert lora_trainable_params(shape, 16, ["q_proj", "v_proj"]) == 32 * 16 * (8192 + 5120)
    # a config dict works as well as a ModelShape
    assert lora_trainable_params(_published("Meta-Llama-3-8B"), 16, ["q_proj", "v_proj"]) == 32 * 16 * 13312


def test_lora_unknown_module_lists_valid_names():
    shape = count_params(_published("Phi-3-mini-4k-instruct"))
    with pytest.raises(ModelConfigError) as err:
        lora_trainable_params(shape, 8, ["q_proj", "qkv_proj"])
    message = str(err.value)
    assert "['q_proj']" in message and "qkv_proj" in message and "gate_up_proj" in message and "phi3" in message
    assert "qkv_proj" in lora_target_names(shape) and "q_proj" not in lora_target_names(shape)


def test_lora_mixtral_experts_follow_peft():
    shape = count_params(_published("Mixtral-8x7B-v0.1"))
    h, i, e, layers = 4096, 14336, 8, 32
    # w1 + w3 are one fused tensor (E, 2I, h) adapted at rank 2r; w2 is (E, h, I) at rank r
    assert lora_trainable_params(shape, 8, ["w1", "w3"]) == layers * 16 * e * (2 * i + h)
    assert lora_trainable_params(shape, 8, ["w2"]) == layers * 8 * e * (i + h)
    assert lora_trainable_params(shape, 8, ["gate"]) == layers * 8 * (h + e)
    with pytest.raises(ModelConfigError, match="w1 needs w3"):
        lora_trainable_params(shape, 8, ["w1"])
    with pytest.raises(ModelConfigError, match="not found"):
        lora_trainable_params(shape, 8, ["gate_up_proj"])  # PEFT rejects the fused name as a target module
    assert {"w1", "w2", "w3", "gate"} <= set(lora_target_names(shape))


def test_lora_all_linear_must_stand_alone():
    with pytest.raises(ModelConfigError, match="alone"):
        lora_trainable_params(count_params(_published("gpt2")), 8, ["all-linear", "wte"])


def test_lora_bad_rank():
    with pytest.raises(ModelConfigError, match="rank"):
        lora_trainable_params(count_params(_published("gpt2")), 0, ["c_attn"])


def test_lora_unknown_family_config_dict():
    with pytest.raises(ModelConfigError, match="count_params_any"):
        lora_trainable_params({"model_type": "falcon"}, 8, ["query_key_value"])
