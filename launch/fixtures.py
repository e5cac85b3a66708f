"""Tiny, deterministic, fully local stand-ins for a model, a tokenizer and a training set.

Why this exists: ftkit's tier-1 tests and ``make demo`` run real DeepSpeed/Accelerate/torchrun jobs on a 2-core
machine with no network, so nothing can come from a model hub. Everything here is generated from a seed:

* :func:`make_tokenizer` trains a byte-level BPE on a fixed corpus (byte-level, so *any* text tokenizes without
  ``<unk>``) and adds a chat template, so ``messages`` data works like it does with a real chat model.
* :func:`make_tiny_model` builds a Llama-style model from a config (no download) and saves it with the tokenizer.
* :func:`make_dataset` writes a small *learnable* data set (colour facts and counting sequences: after a few words
  the rest is fully determined), so a loss curve visibly falls within a few dozen steps.

Two builds with the same arguments give byte-identical files; resume tests rely on that. Heavy imports (torch,
transformers, tokenizers, pyarrow) happen inside functions so importing this module stays cheap.

CLI: ``python -m ftkit.launch.fixtures ROOT [--kind text|prompt_completion|messages] [--rows N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

KINDS = ("text", "prompt_completion", "messages")
FAMILIES = ("llama", "mistral", "qwen2")

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Order fixes the ids: unk=0, bos=1, eos=2, pad=3 (Llama's convention for the first three).
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, *ROLE_TOKENS)

# One turn per message: role marker, content, end-of-sequence. The assistant turn ends in eos so the model learns
# to stop; the generation prompt is exactly the text that precedes an assistant turn's content, which is what
# lets ftkit.launch.data locate assistant tokens by rendering prefixes of the conversation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

COLORS = {
    "apple": "red",
    "banana": "yellow",
    "sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "orange": "orange",
    "plum": "purple",
    "lemon": "yellow",
    "cherry": "red",
    "sea": "blue",
    "leaf": "green",
}
NUMBERS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
)
COUNT_LEN = 6  # words per counting sequence
SYSTEM_PROMPT = "you are a helpful assistant."
DEFAULT_ROWS = 64
TOKENIZER_VOCAB = 512  # target; the corpus is small, so the trained vocabulary may end up a little smaller


def _count(start: int) -> str:
    return " ".join(NUMBERS[start : start + COUNT_LEN]) + "."


def _fact(obj: str) -> tuple[str, str]:
    """(prompt, completion) for one colour fact; the completion starts with a space, as continuations do."""
    return f"the color of the {obj} is", f" {COLORS[obj]}."


def _counting(start: int) -> tuple[str, str]:
    return f"count from {NUMBERS[start]}:", " " + _count(start)


def _pairs() -> list[tuple[str, str]]:
    """Every (prompt, completion) the generator can emit, in a fixed order."""
    facts = [_fact(obj) for obj in COLORS]
    counts = [_counting(start) for start in range(len(NUMBERS) - COUNT_LEN + 1)]
    return facts + counts


def _question(prompt: str) -> str:
    if prompt.startswith("the color of the "):
        return "what is the color of the " + prompt.removeprefix("the color of the ").removesuffix(" is") + "?"
    return prompt.replace("count from", "please count from").rstrip(":") + "."


class Row(TypedDict, total=False):
    """One generated example: the fields of its kind only."""

    text: str
    prompt: str
    completion: str
    messages: list[dict[str, str]]  # {role, content}


def _row(kind: str, rng: random.Random) -> Row:
    prompt, completion = rng.choice(_pairs())
    if kind == "text":
        return {"text": prompt + completion}
    if kind == "prompt_completion":
        return {"prompt": prompt, "completion": completion}
    if kind == "messages":
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
        messages += [
            {"role": "user", "content": _question(prompt)},
            {"role": "assistant", "content": prompt + completion},
        ]
        if rng.random() < 0.3:  # some two-turn conversations, so masking is exercised across turns
            prompt2, completion2 = rng.choice(_pairs())
            messages += [
                {"role": "user", "content": _question(prompt2)},
                {"role": "assistant", "content": prompt2 + completion2},
            ]
        return {"messages": messages}
    raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")


def corpus() -> list[str]:
    """The tokenizer's training text: every sentence the data generator can produce, plus the chat wording."""
    lines = []
    for prompt, completion in _pairs():
        lines += [prompt + completion, _question(prompt), prompt + completion]
    lines += [SYSTEM_PROMPT, "user assistant system"]
    return lines


def make_tokenizer(out_dir: str | Path | None = None, *, vocab_size: int = TOKENIZER_VOCAB) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on :func:`corpus`, wrap it as a ``PreTrainedTokenizerFast`` and save it.

    Returns the tokenizer (also when ``out_dir`` is None, which skips saving). Deterministic: the corpus is
    fixed and the BPE trainer breaks ties by pair order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=256,
        padding_side="right",
    )
    # Role markers must be single, unsplittable tokens so the template's structure survives tokenization.
    fast.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def make_tiny_model(
    out_dir: str | Path,
    *,
    family: str = "llama",
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> Path:
    """Build a randomly initialised decoder from a config and save it (safetensors) with the tokenizer.

    ``vocab_size`` defaults to the tokenizer's size. Weights come from ``torch.manual_seed(seed)`` inside a
    forked RNG (the caller's RNG state is untouched), so the same arguments give byte-identical files.
    ``family`` picks the architecture (llama, mistral, qwen2: same constructor arguments), which lets the
    memory planner's closed-form parameter counts be checked against more than one family.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}; got {family!r}")
    out = Path(out_dir)
    tokenizer = make_tokenizer(out)
    config = AutoConfig.for_model(
        family,
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def make_dataset(path: str | Path, *, kind: str = "text", n_rows: int = DEFAULT_ROWS, seed: int = 0) -> Path:
    """Write ``n_rows`` learnable examples of ``kind``; the format follows the suffix.

    .jsonl (one object per line), .json (an array), .csv (``messages`` as a JSON string column), .parquet
    (``messages`` as a list of structs), .txt (``text`` only: one example per line).
    """
    path = Path(path)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    rng = random.Random(seed)
    rows = [_row(kind, rng) for _ in range(n_rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    elif suffix == ".txt":
        if kind != "text":
            raise ValueError(f".txt holds one text example per line; kind {kind!r} needs .jsonl/.json/.csv/.parquet")
        path.write_text("".join(r["text"] + "\n" for r in rows), encoding="utf-8")
    elif suffix == ".csv":
        fields = list(rows[0])
        with path.open("w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
            writer.writeheader()
            for r in rows:
                writer.writerow({k: json.dumps(v) if k == "messages" else v for k, v in r.items()})
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    else:
        raise ValueError(f"unsupported suffix {path.suffix!r}; use .jsonl, .json, .csv, .parquet or .txt")
    return path


def make_all(root: str | Path, *, kind: str = "text", n_rows: int = DEFAULT_ROWS, seed: int = 0) -> dict[str, Path]:
    """Model + tokenizer in ``root/model``, training data in ``root/data/train.jsonl``; returns the paths."""
    root = Path(root)
    model = make_tiny_model(root / "model", seed=seed)
    data = make_dataset(root / "data" / "train.jsonl", kind=kind, n_rows=n_rows, seed=seed)
    return {"root": root, "model": model, "data": data}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftkit.launch.fixtures",
        description="Write a tiny model, tokenizer and learnable data set for tests and demos (no network).",
        epilog="example: python -m ftkit.launch.fixtures /tmp/ftkit-demo --kind messages --rows 128",
    )
    parser.add_argument("root", help="directory to write model/ and data/train.jsonl into")
    parser.add_argument("--kind", choices=KINDS, default="text", help="data kind (default: text)")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help=f"number of rows (default: {DEFAULT_ROWS})")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data (default: 0)")
    parser.add_argument("--json", action="store_true", help="print the paths as one JSON object")
    args = parser.parse_args(argv)
    paths = make_all(args.root, kind=args.kind, n_rows=args.rows, seed=args.seed)
    if args.json:
        print(json.dumps({k: str(v) for k, v in paths.items()}))
    else:
        for name, p in paths.items():
            print(f"{name}: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
