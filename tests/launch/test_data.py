"""Data loading, checking, tokenizing and padding: every format x kind, exact loss masks, and one test per user
mistake, each checking that the message names the file and the row."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ftkit.errors import DataError, ExitCode
from tests.helpers.paths import REPO

try:
    from ftkit.launch import data, fixtures
except ImportError:  # package not installed yet: use the repo's launch/ directory directly
    sys.path.insert(0, str(REPO))
    from launch import data, fixtures  # type: ignore[no-redef]

pytestmark = pytest.mark.heavy  # builds a tokenizer through transformers in-process

FORMATS = [".jsonl", ".json", ".csv", ".parquet", ".txt"]


@pytest.fixture(scope="module")
def tok() -> Any:
    return fixtures.make_tokenizer()


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _error(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    assert info.value.exit_code == ExitCode.USAGE
    return str(info.value)


def _decode_labels(tok: Any, labels: list[int]) -> str:
    return tok.decode([x for x in labels if x != data.IGNORE_INDEX])


# --------------------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize(
    ("suffix", "kind"),
    [(s, k) for s in FORMATS for k in fixtures.KINDS if s != ".txt" or k == "text"],  # .txt holds text rows only
)
def test_every_format_and_kind_loads(tmp_path: Path, tok: Any, suffix: str, kind: str) -> None:
    reference = data.load_examples(fixtures.make_dataset(tmp_path / "ref.jsonl", kind=kind, n_rows=12, seed=3))
    rows = data.load_examples(fixtures.make_dataset(tmp_path / f"train{suffix}", kind=kind, n_rows=12, seed=3))
    assert list(rows) == list(reference)  # same content whatever the container
    assert data.detect_kind(rows) == kind
    encoded = data.tokenize(rows, tok, 128, kind)
    assert len(encoded) == 12
    assert all(len(r["input_ids"]) == len(r["labels"]) == len(r["attention_mask"]) for r in encoded)


def test_txt_skips_blank_lines_and_keeps_line_numbers(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_text("first\n\n  \nsecond line\n", encoding="utf-8")
    rows = data.load_examples(p)
    assert list(rows) == [{"text": "first"}, {"text": "second line"}]
    assert rows.lines == [1, 4]


def test_csv_line_numbers_survive_multiline_fields(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text('text\n"one\nspanning two lines"\nok\n', encoding="utf-8")
    rows = data.load_examples(p)
    assert rows.lines == [2, 4]
    assert rows[0]["text"] == "one\nspanning two lines"


# --------------------------------------------------------------------------------------------------- masks


def test_text_trains_on_every_token(tok: Any) -> None:
    (row,) = data.tokenize([{"text": "the color of the sky is blue."}], tok, 64, "text")
    assert row["input_ids"][0] == tok.bos_token_id and row["input_ids"][-1] == tok.eos_token_id
    assert row["labels"] == row["input_ids"]
    assert row["attention_mask"] == [1] * len(row["input_ids"])


def test_prompt_is_masked(tok: Any) -> None:
    prompt, completion = "the color of the apple is", " red."
    (row,) = data.tokenize([{"prompt": prompt, "completion": completion}], tok, 64, "prompt_completion")
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tok(completion, add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == [tok.bos_token_id, *p_ids, *c_ids, tok.eos_token_id]
    assert row["labels"] == [-100] * (1 + len(p_ids)) + [*c_ids, tok.eos_token_id]
    assert _decode_labels(tok, row["labels"]) == " red.</s>"


def test_messages_train_on_assistant_turns_only(tok: Any) -> None:
    messages = [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "what is the color of the sky?"},
        {"role": "assistant", "content": "blue."},
        {"role": "user", "content": "and snow?"},
        {"role": "assistant", "content": "white."},
    ]
    (row,) = data.tokenize([{"messages": messages}], tok, 128, "messages")
    assert tok.decode(row["input_ids"]) == tok.apply_chat_template(messages, tokenize=False)
    # exactly the two assistant turns (content + end of turn), nothing from system or user
    assert _decode_labels(tok, row["labels"]) == "blue.</s>\nwhite.</s>\n"
    spans = [i for i, x in enumerate(row["labels"]) if x != -100]
    assert all(row["labels"][i] == row["input_ids"][i] for i in spans)

    (everything,) = data.tokenize([{"messages": messages}], tok, 128, "messages", assistant_only=False)
    assert everything["labels"] == everything["input_ids"] == row["input_ids"]


def test_truncate_cuts_from_the_right(tok: Any) -> None:
    rows = [{"text": "one two three four five six seven eight nine ten"}]
    (row,) = data.tokenize(rows, tok, 5, "text", on_too_long="truncate")
    assert len(row["input_ids"]) == len(row["labels"]) == 5
    assert row["input_ids"][0] == tok.bos_token_id


def test_collate_pads_to_longest(tok: Any) -> None:
    import torch

    (long,) = data.tokenize([{"prompt": "count from one:", "completion": " one two."}], tok, 64)
    (short,) = data.tokenize([{"text": "hi"}], tok, 64)
    batch = data.collate([short, long], pad_id=tok.pad_token_id)
    width = len(long["input_ids"])
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (2, width) for k in batch}
    assert all(v.dtype == torch.long for v in batch.values())
    pad = width - len(short["input_ids"])
    assert batch["input_ids"][0, -pad:].tolist() == [tok.pad_token_id] * pad
    assert batch["attention_mask"][0, -pad:].tolist() == [0] * pad
    assert batch["labels"][0, -pad:].tolist() == [-100] * pad
    assert batch["labels"][1].tolist() == long["labels"]


def test_collate_under_sequence_parallelism_pads_to_a_multiple_of_sp_or_the_fixed_width_with_positions() -> None:
    """Issue 40: Ulysses splits each sequence into sp equal slices and needs position_ids; on gloo every batch of the
    SP group must have one width (launch/train.py passes data.max_seq_len)."""
    rows = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [5, 6, 7]}]
    sp2 = data.collate(rows, pad_id=0, sp=2)
    assert sp2["input_ids"].tolist() == [[5, 6, 7, 0]] and sp2["labels"].tolist() == [[5, 6, 7, -100]]
    assert sp2["position_ids"].tolist() == [[0, 1, 2, 3]]
    fixed = data.collate(rows, pad_id=0, sp=2, width=8)
    assert fixed["input_ids"].shape == (1, 8) and fixed["position_ids"].tolist() == [list(range(8))]
    assert "position_ids" not in data.collate(rows, pad_id=0)


# --------------------------------------------------------------------------------------------------- errors


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.jsonl"
    assert _error(data.load_examples, p) == f"{p}: no such file"


def test_unsupported_suffix(tmp_path: Path) -> None:
    p = tmp_path / "train.xlsx"
    p.write_text("x")
    msg = _error(data.load_examples, p)
    assert msg.startswith(f"{p}: unsupported file type '.xlsx'") and ".jsonl" in msg


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("e.jsonl", "", "no rows"),
        ("e.jsonl", "\n  \n", "no rows"),
        ("e.json", "[]", "no rows"),
        ("e.txt", "\n\n", "no rows"),
        ("e.csv", "text\n", "only a header"),
        ("e.csv", "", "no rows"),
    ],
)
def test_empty_file(tmp_path: Path, name: str, content: str, expected: str) -> None:
    p = tmp_path / name
    p.write_text(content, encoding="utf-8")
    msg = _error(data.load_examples, p)
    assert msg.startswith(f"{p}: ") and expected in msg


def test_bad_json_lines_all_reported(tmp_path: Path) -> None:
    rows: list[Any] = [{"text": f"row {i}"} for i in range(1, 9)]
    rows[2] = '{"text": "unterminated'
    rows[6] = "{'text': 'single quotes'}"
    p = _jsonl(tmp_path / "train.jsonl", rows)
    lines = _error(data.load_examples, p).splitlines()
    assert [ln.split(": ", 1)[0] for ln in lines] == [f"{p}:3", f"{p}:7"]
    assert all("bad JSON" in ln for ln in lines)


def test_non_object_line(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "train.jsonl", [{"text": "a"}, [1, 2]])
    assert _error(data.load_examples, p) == f"{p}:2: expected a JSON object per line, got list"


def test_json_array_errors(tmp_path: Path) -> None:
    p = tmp_path / "train.json"
    p.write_text('{"text": "a"}\n{"text": "b"}\n')
    msg = _error(data.load_examples, p)
    assert msg.startswith(f"{p}:2: bad JSON: Extra data") and ".jsonl" in msg
    p.write_text('{"text": "a"}')
    assert _error(data.load_examples, p) == f"{p}: expected a JSON array of objects, got dict"
    p.write_text('[{"text": "a"}, "b"]')
    assert _error(data.load_examples, p) == f"{p}: index 1: expected a JSON object, got str"


def test_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "train.txt"
    p.write_bytes(b"fine\nnot \xff utf8\n")
    assert _error(data.load_examples, p) == f"{p}:2: not UTF-8 text (byte 9)"


def test_wrong_fields_named_by_line(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "train.jsonl", [{"text": "a"}, {"text": "b"}, {"foo": 1}])
    msg = _error(data.detect_kind, data.load_examples(p))
    assert msg == f"{p}:3: expected 'text', or 'prompt'+'completion', or 'messages'; found keys ['foo']"


def test_wrong_fields_named_by_index_in_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "a", "foo": None}, {"text": None, "foo": "x"}]), str(p))
    msg = _error(data.detect_kind, data.load_examples(p))
    expected = "expected 'text', or 'prompt'+'completion', or 'messages'; found keys ['foo'] (null: ['text'])"
    assert msg == f"{p}: index 1: {expected}"


def test_csv_errors_use_file_lines(tmp_path: Path) -> None:
    p = tmp_path / "train.csv"
    p.write_text('prompt,completion\na,b\n"x\ny",\nc,d,e\n', encoding="utf-8")
    lines = _error(data.load_examples, p).splitlines()
    assert lines == [f"{p}:5: more fields than the header's 2"]
    p.write_text('prompt,completion\na,b\n"x\ny",\n', encoding="utf-8")
    msg = _error(data.detect_kind, data.load_examples(p))
    assert msg == f"{p}:3: 'completion' is empty, so there is nothing to learn"


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prompt": "a"}, "'prompt' and 'completion' go together; 'completion' is missing; found keys ['prompt']"),
        ({"text": "a", "messages": []}, "has fields of more than one kind (text and messages); keep one"),
        ({"text": ""}, "'text' must be a non-empty string"),
        ({"messages": []}, "'messages' must be a non-empty list of {role, content}"),
        ({"messages": [{"role": "user"}]}, "messages[0] must be an object with string 'role' and 'content'"),
    ],
)
def test_malformed_rows(tmp_path: Path, row: dict[str, Any], expected: str) -> None:
    p = _jsonl(tmp_path / "train.jsonl", [{"text": "ok"}, row])
    msg = _error(data.detect_kind, data.load_examples(p))
    assert msg.startswith(f"{p}:2: {expected}")


def test_inconsistent_kinds(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "train.jsonl", [{"text": "a"}, {"prompt": "q", "completion": "r"}, {"text": "b"}])
    msg = _error(data.detect_kind, data.load_examples(p))
    assert msg == f"{p}:2: row is 'prompt_completion' but line 1 is 'text'; all rows must be of one kind"


def test_problems_are_capped(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "train.jsonl", ["not json"] * 15)
    lines = _error(data.load_examples, p).splitlines()
    assert len(lines) == data.MAX_PROBLEMS + 1
    assert lines[0].startswith(f"{p}:1: bad JSON") and lines[9].startswith(f"{p}:10: bad JSON")
    assert lines[-1] == f"{p}: ... and 5 more problem(s) not shown"


def test_too_long_rows_reported_with_the_fix(tmp_path: Path, tok: Any) -> None:
    long = " apple" * 30
    rows = [{"text": "short."}] * 11 + [{"text": long}]
    p = _jsonl(tmp_path / "train.jsonl", rows)
    n = len(tok(long, add_special_tokens=False)["input_ids"]) + 2  # bos and eos
    msg = _error(data.prepare, p, tok, 16)
    assert msg == f"{p}:12: row has {n} tokens, data.max_seq_len is 16; raise max_seq_len or set data.truncate: true"
    assert len(data.prepare(p, tok, 16, on_too_long="truncate")[-1]["input_ids"]) == 16


def test_truncation_that_leaves_nothing_to_learn(tmp_path: Path, tok: Any) -> None:
    p = _jsonl(tmp_path / "train.jsonl", [{"prompt": " ".join(["apple"] * 30), "completion": " red."}])
    msg = _error(data.prepare, p, tok, 8, on_too_long="truncate")
    assert msg.startswith(f"{p}:1: after truncation to data.max_seq_len 8 no tokens with loss remain")


def test_conversation_without_assistant(tmp_path: Path, tok: Any) -> None:
    p = _jsonl(tmp_path / "train.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert _error(data.prepare, p, tok, 64).startswith(f"{p}:1: no assistant turn")


def test_messages_need_a_chat_template(tmp_path: Path) -> None:
    bare = fixtures.make_tokenizer()
    bare.chat_template = None
    p = fixtures.make_dataset(tmp_path / "train.jsonl", kind="messages", n_rows=2)
    assert _error(data.prepare, p, bare, 64).startswith(f"{p}: 'messages' data needs a tokenizer with a chat template")


def test_template_refusal_is_a_data_error(tmp_path: Path) -> None:
    strict = fixtures.make_tokenizer()
    strict.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    )
    p = _jsonl(tmp_path / "train.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    msg = _error(data.prepare, p, strict, 64)
    assert msg == f"{p}:1: the chat template rejected this conversation: first must be user"
