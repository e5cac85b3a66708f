"""The quick tests' model and recipe: a tiny Llama config.json and the smallest valid recipe (the conftest's
``model_dir`` and ``write_recipe`` fixtures write them)."""

from __future__ import annotations

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

MINIMAL = """\
model:
  path: ./model
data:
  train: ./data.jsonl
train:
  output_dir: ./run
  micro_batch_size: 2
  global_batch_size: 16
cluster:
  gpus_per_node: 8
"""
