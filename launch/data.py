"""Training data: load a file, check it, tokenize it, pad batches.

Three kinds of rows, the same three TRL and most recipes use:

* ``text``: ``{"text": ...}``; loss on every token.
* ``prompt_completion``: ``{"prompt": ..., "completion": ...}``; the prompt is masked (label -100), so the loss
  is on the completion (and the closing eos) only.
* ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the tokenizer's chat
  template; by default the loss is on assistant turns only (see :func:`encode_messages` for how they are found).

Formats follow the suffix: .jsonl, .json (an array of objects), .csv (a ``messages`` column holds JSON),
.parquet, .txt (one ``text`` example per non-empty line). Extra columns are ignored.

Every mistake in the data is a :class:`ftkit.errors.DataError` whose lines name the file and the row: the 1-based
line for .jsonl/.csv/.txt (``train.jsonl:7: ...``), the 0-based index for .json/.parquet
(``train.parquet: index 3: ...``). Up to :data:`MAX_PROBLEMS` problems are collected and reported at once, so a
user fixes a file in one pass, not one error per run.

Importing this module is cheap: pyarrow and torch are imported inside the functions that need them.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from ftkit.errors import DataError, Problem
from ftkit.rundir.records import JSONObject

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

Kind = Literal["text", "prompt_completion", "messages"]
KINDS: tuple[str, ...] = ("text", "prompt_completion", "messages")
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")
LINE_BASED = (".jsonl", ".csv", ".txt")
MAX_PROBLEMS = 10  # report this many, then a count: enough to fix a file in one pass without flooding a terminal
IGNORE_INDEX = -100  # the label PyTorch's cross-entropy (and HF models) skip
FIELDS_HINT = "expected 'text', or 'prompt'+'completion', or 'messages'"


class Examples(list[JSONObject]):
    """Rows as loaded (a ``list[dict]``), plus where each came from, so later checks can point at file and row.

    ``lines[i]`` is the 1-based line of row ``i`` in a line-based file, or None for .json/.parquet (whose rows
    are named by index).
    """

    def __init__(self, rows: list[JSONObject], path: str, lines: list[int | None]):
        super().__init__(rows)
        self.path = path
        self.lines = lines


class _Problems:
    """Collects problems up to a cap and raises them together."""

    def __init__(self, path: str | None):
        self.path = path
        self.items: list[Problem] = []
        self.dropped = 0

    def add(self, message: str, line: int | None = None, index: int | None = None) -> None:
        if len(self.items) >= MAX_PROBLEMS:
            self.dropped += 1
            return
        if line is None and index is not None:
            message = f"index {index}: {message}"
        self.items.append(Problem(message, file=self.path, line=line))

    def at(self, rows: list[JSONObject], i: int, message: str) -> None:
        """Record a problem with row ``i`` of ``rows``, by line when the file has lines, by index otherwise."""
        lines = getattr(rows, "lines", None)
        line = lines[i] if lines is not None else None
        self.add(message, line=line, index=None if line is not None else i)

    def raise_if_any(self) -> None:
        if self.dropped:
            self.items.append(Problem(f"... and {self.dropped} more problem(s) not shown", file=self.path))
        if self.items:
            raise DataError(self.items)


def _path_of(rows: list[JSONObject], path: str | Path | None) -> str | None:
    if path is not None:
        return str(path)
    return getattr(rows, "path", None)


# --------------------------------------------------------------------------------------------------- loading


def load_examples(path: str | Path) -> Examples:
    """Read every row of a data file as a dict; raise DataError for a missing/empty/unparsable file.

    Only the file's structure is checked here; :func:`detect_kind` checks the fields.
    """
    spelled = str(path)  # keep the user's spelling in messages
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(
            Problem(f"unsupported file type {p.suffix or '(none)'!r}; use {', '.join(SUFFIXES)}", file=spelled)
        )
    if not p.exists():
        raise DataError(Problem("no such file", file=spelled))
    if not p.is_file():
        raise DataError(Problem("not a regular file (a directory?); give the path of a data file", file=spelled))
    problems = _Problems(spelled)
    text = ""
    if suffix == ".parquet":
        rows, lines = _read_parquet(p, problems)
    else:
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8-sig")  # tolerate a BOM, which spreadsheet exports add
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise DataError(Problem(f"not UTF-8 text (byte {e.start})", file=spelled, line=line)) from None
        reader = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".txt": _read_txt}[suffix]
        rows, lines = reader(text, problems)
    problems.raise_if_any()
    if not rows:
        what = "only a header, no rows" if suffix == ".csv" and text.strip() else "no rows (the file is empty)"
        raise DataError(Problem(what, file=spelled))
    return Examples(rows, spelled, lines)


def _read_jsonl(text: str, problems: _Problems) -> tuple[list[JSONObject], list[int | None]]:
    rows: list[JSONObject] = []
    lines: list[int | None] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.add(f"bad JSON: {e.msg} (column {e.colno})", line=n)
            continue
        if not isinstance(obj, dict):
            problems.add(f"expected a JSON object per line, got {type(obj).__name__}", line=n)
            continue
        rows.append(obj)
        lines.append(n)
    return rows, lines


def _read_json(text: str, problems: _Problems) -> tuple[list[JSONObject], list[int | None]]:
    if not text.strip():
        return [], []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        hint = ""
        if e.msg == "Extra data":  # several top-level values: almost always JSON lines saved as .json
            hint = "; this looks like JSON lines (one object per line): name the file .jsonl"
        problems.add(f"bad JSON: {e.msg} (column {e.colno}){hint}", line=e.lineno)
        return [], []
    if not isinstance(data, list):
        problems.add(f"expected a JSON array of objects, got {type(data).__name__}")
        return [], []
    rows: list[JSONObject] = []
    for i, obj in enumerate(data):
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            problems.add(f"expected a JSON object, got {type(obj).__name__}", index=i)
    return rows, [None] * len(rows)


def _read_csv(text: str, problems: _Problems) -> tuple[list[JSONObject], list[int | None]]:
    # The csv module, not pandas: values stay strings (pandas would turn "123" into an int and "" into NaN).
    reader = csv.DictReader(text.splitlines(keepends=True))
    rows: list[JSONObject] = []
    lines: list[int | None] = []
    end = 1  # last line of the header; a quoted field may span lines, so each record starts after the last one
    try:
        for record in reader:
            start, end = end + 1, reader.line_num
            if None in record:
                problems.add(f"more fields than the header's {len(reader.fieldnames or [])}", line=start)
                continue
            if not any((v or "").strip() for v in record.values()):
                continue  # a blank line
            row: JSONObject = dict(record)
            messages = row.get("messages")
            if isinstance(messages, str):
                try:
                    row["messages"] = json.loads(messages)
                except json.JSONDecodeError as e:
                    problems.add(f"column 'messages' is not valid JSON: {e.msg} (column {e.colno})", line=start)
                    continue
            rows.append(row)
            lines.append(start)
    except csv.Error as e:
        problems.add(f"bad CSV: {e}", line=reader.line_num)
    return rows, lines


def _read_txt(text: str, problems: _Problems) -> tuple[list[JSONObject], list[int | None]]:
    rows: list[JSONObject] = []
    lines: list[int | None] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            rows.append({"text": line})
            lines.append(n)
    return rows, lines


def _read_parquet(p: Path, problems: _Problems) -> tuple[list[JSONObject], list[int | None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(str(p)).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as e:  # a corrupt or non-Parquet file
        problems.add(f"cannot read Parquet: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        return [], []
    return rows, [None] * len(rows)


# --------------------------------------------------------------------------------------------------- checking


def _row_kind(row: JSONObject) -> tuple[Kind | None, str | None]:
    """(kind, None) for a well-formed row, (None, what is wrong) otherwise."""
    has = {k for k in ("text", "prompt", "completion", "messages") if row.get(k) is not None}
    # Parquet/JSON rows can carry a field as null (a column another row fills): report it as such, not as present.
    nulls = sorted(k for k, v in row.items() if v is None)
    found = f"found keys {sorted(k for k in row if k not in nulls)}" + (f" (null: {nulls})" if nulls else "")
    candidates: tuple[tuple[Kind, bool], ...] = (
        ("text", "text" in has),
        ("prompt_completion", "prompt" in has or "completion" in has),
        ("messages", "messages" in has),
    )
    kinds = [k for k, ok in candidates if ok]
    if not kinds:
        return None, f"{FIELDS_HINT}; {found}"
    if len(kinds) > 1:
        return None, f"has fields of more than one kind ({' and '.join(kinds)}); keep one; {found}"
    kind = kinds[0]
    if kind == "text":
        if not isinstance(row["text"], str) or not row["text"].strip():
            return None, "'text' must be a non-empty string"
    elif kind == "prompt_completion":
        missing = [k for k in ("prompt", "completion") if k not in has]
        if missing:
            return None, f"'prompt' and 'completion' go together; '{missing[0]}' is missing; {found}"
        if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str):
            return None, "'prompt' and 'completion' must be strings"
        if not row["completion"].strip():
            return None, "'completion' is empty, so there is nothing to learn"
    else:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            return None, "'messages' must be a non-empty list of {role, content}"
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return None, f"messages[{j}] must be an object with string 'role' and 'content'"
    return kind, None


def detect_kind(rows: list[JSONObject], path: str | Path | None = None) -> Kind:
    """Return the kind shared by every row; raise DataError listing malformed rows and rows of another kind.

    The first well-formed row sets the kind: mixing kinds in one file is refused rather than guessed, because a
    silently masked or unmasked prompt changes what the model learns.
    """
    problems = _Problems(_path_of(rows, path))
    if not rows:
        problems.add("no rows")
        problems.raise_if_any()
    kind: Kind | None = None
    first = 0
    for i, row in enumerate(rows):
        this, error = _row_kind(row)
        if error:
            problems.at(rows, i, error)
        elif kind is None:
            kind, first = this, i
        elif this != kind:
            lines = getattr(rows, "lines", None)
            ref = f"line {lines[first]}" if lines is not None and lines[first] else f"index {first}"
            problems.at(rows, i, f"row is '{this}' but {ref} is '{kind}'; all rows must be of one kind")
    problems.raise_if_any()
    assert kind is not None  # invariant: rows is non-empty and every row passed
    return kind


# --------------------------------------------------------------------------------------------------- tokenizing


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos_eos(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """Explicit bos/eos ids (either may be absent, e.g. Qwen has no bos) instead of the tokenizer's
    post-processor, whose behaviour varies between models."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return bos, eos


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[JSONObject], add_generation_prompt: bool) -> str:
    conversation = cast("list[dict[str, str]]", messages)  # checked rows: every message has string role/content
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    return cast(str, rendered)  # tokenize=False: the rendered text


def encode_messages(
    tokenizer: PreTrainedTokenizerBase, messages: list[JSONObject], assistant_only: bool = True
) -> tuple[list[int], list[int]] | str:
    """(input_ids, labels) for one conversation, or a message saying why it cannot be encoded.

    Assistant tokens are found by rendering prefixes: the tokens of ``messages[:i]`` with the generation prompt
    and of ``messages[:i+1]`` bracket assistant turn ``i`` (content, end-of-turn and whatever the template puts
    after it). This works for any template that renders a conversation's prefixes as token prefixes of the
    whole, which holds for common templates; when it does not, the row is reported instead of silently training
    on the wrong tokens. It does not need ``{% generation %}`` markers in the template.
    """
    from jinja2 import TemplateError

    try:
        return _encode_messages(tokenizer, messages, assistant_only)
    except TemplateError as e:  # templates raise on conversations they refuse, e.g. roles that do not alternate
        return f"the chat template rejected this conversation: {e}"


def _encode_messages(
    tokenizer: PreTrainedTokenizerBase, messages: list[JSONObject], assistant_only: bool
) -> tuple[list[int], list[int]] | str:
    ids = _encode(tokenizer, _render(tokenizer, messages, add_generation_prompt=False))
    if not assistant_only:
        return ids, list(ids)
    labels = [IGNORE_INDEX] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _encode(tokenizer, _render(tokenizer, messages[:i], add_generation_prompt=True))
        through = _encode(tokenizer, _render(tokenizer, messages[: i + 1], add_generation_prompt=False))
        if through[: len(before)] != before or ids[: len(through)] != through:
            return (
                f"the chat template does not render messages[:{i + 1}] as a prefix of the conversation, so the "
                "assistant tokens cannot be located; train on all tokens (assistant_only=False) or fix the template"
            )
        labels[len(before) : len(through)] = through[len(before) :]
    if all(label == IGNORE_INDEX for label in labels):
        return "no assistant turn, so there is nothing to learn; add one or remove the row"
    return ids, labels


def tokenize(
    rows: list[JSONObject],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    kind: Kind | None = None,
    on_too_long: Literal["error", "truncate"] = "error",
    *,
    path: str | Path | None = None,
    assistant_only: bool = True,
) -> list[dict[str, list[int]]]:
    """Turn rows into ``{"input_ids", "attention_mask", "labels"}`` lists (unpadded; see :func:`collate`).

    * text: ``bos + text + eos``, labels = input_ids.
    * prompt_completion: ``bos + prompt + completion + eos``; prompt positions (and bos) are labelled -100.
      Prompt and completion are tokenized separately, so the boundary is exact.
    * messages: the chat template's rendering (it adds its own bos/eos); assistant turns only unless
      ``assistant_only`` is False.

    Rows longer than ``max_seq_len`` tokens are errors (``on_too_long="error"``, all reported at once) or are cut
    from the right (``"truncate"``); a cut that leaves no label tokens is an error either way, because such a row
    contributes nothing but can make a whole batch's loss NaN. ``kind`` None means :func:`detect_kind`.
    """
    if on_too_long not in ("error", "truncate"):
        raise ValueError(f"on_too_long must be 'error' or 'truncate'; got {on_too_long!r}")
    where = _path_of(rows, path)
    if kind is None:
        kind = detect_kind(rows, where)
    problems = _Problems(where)
    if kind == "messages" and not getattr(tokenizer, "chat_template", None):
        problems.add("'messages' data needs a tokenizer with a chat template, and this tokenizer has none")
        problems.raise_if_any()
    bos, eos = _bos_eos(tokenizer)
    out: list[dict[str, list[int]]] = []
    for i, row in enumerate(rows):
        if kind == "text":
            ids = bos + _encode(tokenizer, cast(str, row["text"])) + eos
            labels = list(ids)
        elif kind == "prompt_completion":
            prompt = bos + _encode(tokenizer, cast(str, row["prompt"]))
            completion = _encode(tokenizer, cast(str, row["completion"])) + eos
            ids = prompt + completion
            labels = [IGNORE_INDEX] * len(prompt) + completion
        elif kind == "messages":
            encoded = encode_messages(tokenizer, cast("list[JSONObject]", row["messages"]), assistant_only)
            if isinstance(encoded, str):
                problems.at(rows, i, encoded)
                continue
            ids, labels = encoded
        else:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
        if len(ids) > max_seq_len:
            if on_too_long == "error":
                problems.at(
                    rows,
                    i,
                    f"row has {len(ids)} tokens, data.max_seq_len is {max_seq_len}; "
                    "raise max_seq_len or set data.truncate: true",
                )
                continue
            ids, labels = ids[:max_seq_len], labels[:max_seq_len]
            if all(label == IGNORE_INDEX for label in labels):
                problems.at(
                    rows,
                    i,
                    f"after truncation to data.max_seq_len {max_seq_len} no tokens with loss "
                    "remain (the prompt alone fills it); raise max_seq_len or shorten the prompt",
                )
                continue
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    problems.raise_if_any()
    return out


def prepare(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    *,
    on_too_long: Literal["error", "truncate"] = "error",
    assistant_only: bool = True,
) -> list[dict[str, list[int]]]:
    """Load, check and tokenize a data file in one call (what the training entry uses)."""
    rows = load_examples(path)
    return tokenize(rows, tokenizer, max_seq_len, detect_kind(rows), on_too_long, assistant_only=assistant_only)


def collate(
    batch: list[dict[str, list[int]]], pad_id: int, sp: int = 1, width: int | None = None
) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest row (right padding) and stack it into tensors.

    ``pad_id`` fills input_ids, 0 fills attention_mask and -100 fills labels, so padding never contributes to
    the loss. Use ``functools.partial(collate, pad_id=tokenizer.pad_token_id)`` as a Trainer data collator.

    ``sp`` > 1 (sequence parallelism, DeepSpeed's Ulysses): the width is padded up to a multiple of ``sp`` so each rank
    of the group gets an equal slice, and ``position_ids`` come with the batch, which Ulysses needs for each token
    to keep its position once the sequence is split (right padding under causal attention changes no real token's
    output, so the mask Ulysses does not pass on is not missed). ``width``: every batch padded to at least this many
    tokens.
    """
    import torch

    width = max(max(len(row["input_ids"]) for row in batch), width or 0)
    width += -width % sp
    fill = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}
    out = {
        key: torch.tensor([row[key] + [value] * (width - len(row[key])) for row in batch], dtype=torch.long)
        for key, value in fill.items()
    }
    if sp > 1:
        out["position_ids"] = torch.arange(width, dtype=torch.long).expand(len(batch), width).clone()
    return out
