"""``ftkit export``: the trained model out of a committed checkpoint, written for ``from_pretrained`` and proven
by its logits.

Two entry points, and the run's ``final/`` is meant to be produced through the first one too:

- :func:`export` reads one committed, verified checkpoint (ZeRO-0..3 with or without offload, DeepSpeed's
  universal checkpoint, the HF files of ``final/``, LoRA adapters), streams its weights into sharded safetensors
  with the index (peak host memory about one tensor, not the model), adds config, generation config, tokenizer
  and a model card, checks the logits against an independent loading of the same checkpoint, writes a commit
  record for the export, and only then renames the directory into place;
- :func:`verify_export` re-checks an earlier export: its files against its commit record, then the logits against
  the checkpoint it came from.

Everything is written into a hidden staging directory beside the destination (same parent, so the final rename
is atomic); a refused or failed export leaves the destination exactly as it was. The controller stays
import-light: torch, transformers, deepspeed, peft are imported inside the functions that need them, after every
refusal that needs none of them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ftkit.checkpoint.checksums import full_checksum
from ftkit.checkpoint.commit import write_commit
from ftkit.checkpoint.layout import _fsync_path
from ftkit.checkpoint.verify import verify as verify_checkpoint  # ftkit.export.logits is a submodule
from ftkit.cluster.procs import is_alive
from ftkit.errors import ExitCode, ExportMismatch, FtkitError, Problem, UserError
from ftkit.export import card, weights
from ftkit.export import weights as w
from ftkit.export.card import read_record
from ftkit.export.logits import Verdict, prove
from ftkit.export.lora import adapter_entries, lora_math, merge_transform
from ftkit.export.source import (
    ADAPTER_CONFIG,
    FINAL,
    LATEST_CHOICE,
    CheckpointGone,
    ExportRefused,
    RunFacts,
    Source,
    hold,
    parse_choice,
    release,
    remove_stale_holds,
    resolve,
    run_facts,
    unheld,
)
from ftkit.export.weights import OUT_DTYPES, Reader, parse_size
from ftkit.run.fingerprint import changed_weights
from ftkit.rundir.outputs import run_state
from ftkit.rundir.records import CommitExtra, FileEntry

__all__ = [
    "ExportResult",
    "ExportRefused",
    "ExportMismatch",
    "CheckpointGone",
    "ExportTorn",
    "Verdict",
    "export",
    "verify_export",
    "default_out",
]

KINDS = ("full", "merged", "adapter")
LORA_CHOICES = ("merge", "adapter")
_STAGING = ".ftkit-export-"
_CKPT_NAME = re.compile(r"^checkpoint-\d+")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
)


class ExportTorn(FtkitError):
    """``--verify DIR``: a file of the export differs from the export's own commit record (exit 13)."""

    exit_code = ExitCode.VERIFY_FAILED


@dataclass
class ExportResult:
    path: Path
    source: Source
    kind: str  # full | merged | adapter
    dtype: str  # fp32 | bf16 | fp16
    files: list[str]
    tensors: int
    bytes: int
    seconds: float  # reading and writing the weights
    peak_rss_bytes: int | None  # of this process while reading and writing the weights
    verdict: Verdict | None


def _silent(line: str) -> None:  # noqa: ARG001
    pass


# ------------------------------------------------------------------------------------------------- export


def export(
    run_dir: str | os.PathLike[str],
    checkpoint: str | int | None = None,
    out: str | os.PathLike[str] | None = None,
    *,
    lora: str | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    universal: bool = False,
    verify: bool = True,
    force: bool = False,
    allow_final: bool = False,
    commit_extra: CommitExtra | None = None,
    probe: str | os.PathLike[str] | None = None,
    note: Callable[[str], None] = _silent,
) -> ExportResult:
    """Export one committed checkpoint of ``run_dir`` to ``out`` (default ``RUN/exports/<checkpoint>``).

    ``checkpoint``: a step, ``"latest"``, ``"final"`` or None (``final/`` when committed, else latest).
    ``lora`` (LoRA runs only): ``"merge"`` (the default: a full model ``from_pretrained`` loads without PEFT or
    the base model) or ``"adapter"`` (PEFT's adapter files). ``dtype``: fp32 | bf16 | fp16, default the run's
    training precision. ``universal``: read the checkpoint's DeepSpeed universal checkpoint instead of its ZeRO
    shards. ``verify`` (default): prove the export by logits before putting it in place; a mismatch raises
    :class:`ExportMismatch` (exit 15) and leaves ``out`` untouched. ``force``: replace a non-empty ``out``
    (atomically: the old directory is renamed aside, the new one renamed in, then the old one deleted).
    ``allow_final``: ``out`` may be the run's own ``final/`` (how the training entry can produce it through this
    function); ``commit_extra`` goes into the export's commit record (e.g. ``{"final": True, "attempt": N}``);
    ``probe``: a ``probe.json`` of logits the live model computed (``{"input_ids", "logits"}``, what the built-in
    entry writes to ``RUN/ftkit/probe.json``), judged as one more reference (exporting ``final/`` uses the run's own).

    Refusals, all before anything is written: a checkpoint that is not committed or fails verification, or
    whose layout cannot be read (:class:`ExportRefused`, exit 5); bad options or destination (exit 2).
    """
    source = _take(run_dir, checkpoint, universal, note)
    try:
        facts = run_facts(source)
        kind = _kind(source, lora)
        dtype = _dtype(dtype, facts)
        max_bytes = _size(max_shard_size)
        target = Path(out) if out is not None else default_out(source, kind)
        _check_target(target, source, force=force, allow_final=allow_final)
        for line in source.skipped:
            note(f"skipped: {line}")
        note(f"source: {source.reason}; reading {source.describe()}")
        if kind == "merged":
            note(f"LoRA: merging the adapter into {facts.model_path} (--adapter writes the adapter alone)")
            _check_base(_base_dir(facts), facts)  # before anything is written

        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(target)
        staging = target.parent / f".{target.name}{_STAGING}{os.getpid()}-{secrets.token_hex(4)}"
        staging.mkdir()
        try:
            import torch  # noqa: F401 - imported before the peak is reset: the phase's peak is then its data's

            t0 = time.monotonic()
            _reset_peak_rss()
            files, tensors, nbytes = _write(staging, source, facts, kind, dtype, max_bytes)
            seconds = round(time.monotonic() - t0, 2)
            peak = _peak_rss()
            shards = [f for f in files if f.endswith(".safetensors")]
            note(
                f"wrote {len(shards)} safetensors file(s), {tensors} tensors, {weights.human(nbytes)} {dtype} in "
                f"{seconds:.2f} s" + (f", peak RSS {weights.human(peak)}" if peak else "")
            )
            verdict = None
            if verify:
                _reset_peak_rss()
                verdict = prove(staging, source, facts, kind, dtype, probe=None if probe is None else Path(probe))
                verdict.peak_rss_bytes = _peak_rss()
                _say(verdict, note)
                if not verdict.ok:
                    raise ExportMismatch(
                        f"{source.name}: the export's logits differ from the checkpoint's ({verdict.summary()}); "
                        f"nothing was written to {target}"
                    )
            _finish(
                staging,
                target,
                source,
                facts,
                kind,
                dtype,
                files,
                tensors,
                nbytes,
                max_bytes,
                seconds,
                peak,
                verdict,
                commit_extra,
            )
            _put_in_place(staging, target, force=force)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        note(f"exported {source.name} (step {source.step}) to {target}")
        return ExportResult(target, unheld(source), kind, dtype, files, tensors, nbytes, seconds, peak, verdict)
    except ExportRefused:
        if source.path.exists():
            raise
        raise CheckpointGone(  # read in place (the run directory could not hold it): the run's rotation deleted it
            f"{source.name} was deleted by the run's checkpoint rotation (the run is still training) while it was "
            "exported; it was not damaged: export a newer one (--checkpoint latest)"
        ) from None
    finally:
        release(source)


HOLD_TRIES = 3  # a live run saving faster than an export can hold its newest checkpoint: give up after this many


def _take(
    run_dir: str | os.PathLike[str], checkpoint: str | int | None, universal: bool, note: Callable[[str], None]
) -> Source:
    """The checkpoint to export, verified and held against the run's rotation (:func:`ftkit.export.source.hold`).
    When the newest committed one was asked for (``latest``, or the default without a committed final/) and the
    live run rotated it away before it was held, the newest one is chosen again."""
    source = resolve(run_dir, checkpoint, universal=universal)
    remove_stale_holds(source.run_dir)
    for tries in range(1, HOLD_TRIES + 1):
        try:
            return hold(source)
        except CheckpointGone:
            if parse_choice(checkpoint) not in (None, LATEST_CHOICE) or tries == HOLD_TRIES:
                raise
            note(f"{source.name} was rotated away by the live run before it was held: choosing the newest again")
            source = resolve(run_dir, checkpoint, universal=universal)
    raise AssertionError("unreachable")  # pragma: no cover


def default_out(source: Source, kind: str) -> Path:
    """``RUN/exports/<checkpoint-N|final>`` (``-adapter`` appended for an adapter export)."""
    return source.run_dir / "exports" / (source.name + ("-adapter" if kind == "adapter" else ""))


def _kind(source: Source, lora: str | None) -> str:
    if lora is not None and lora not in LORA_CHOICES:
        raise ValueError(f"lora must be one of {LORA_CHOICES}, got {lora!r}")
    if not source.is_lora:
        if lora is not None:
            flag = "--merge-lora" if lora == "merge" else "--adapter"
            raise UserError(Problem(f"{source.name} is not a LoRA checkpoint (no {ADAPTER_CONFIG})", key=flag))
        return "full"
    return "adapter" if lora == "adapter" else "merged"


def _dtype(dtype: str | None, facts: RunFacts) -> str:

    chosen = dtype or facts.precision
    if chosen not in OUT_DTYPES:
        raise UserError(Problem(f"{chosen!r} is not one of {', '.join(OUT_DTYPES)}", key="--dtype"))
    return chosen


def _size(text: str | int) -> int:

    try:
        return parse_size(text)
    except ValueError as e:
        raise UserError(Problem(str(e), key="--max-shard-size")) from None


def _check_target(target: Path, source: Source, *, force: bool, allow_final: bool) -> None:
    """Refuse a destination that would damage the run or another directory, before anything is written."""
    where = str(target)
    t = target.resolve()
    src, run = (source.run_dir / source.name).resolve(), source.run_dir.resolve()  # the checkpoint, not its hold
    if t == src or src in t.parents or t in src.parents:
        raise UserError(Problem(f"overlaps {source.name}, the checkpoint being exported", file=where, key="-o"))
    if t.parent == run and (_CKPT_NAME.match(t.name) or (t.name == FINAL and not allow_final)):
        raise UserError(Problem("is a name the run itself uses (checkpoint-N, final); pick another", file=where))
    state = None if allow_final and t == run / FINAL else run_state(t)
    if state is not None:  # this run's or another's: its records, logs, checkpoints (--force or not)
        raise UserError(Problem(f"{state}: an export never goes there; pick another", file=where, key="-o"))
    if t.exists() or t.is_symlink():
        if not t.is_dir() or target.is_symlink():
            raise UserError(Problem("exists and is not a directory", file=where, key="-o"))
        if any(t.iterdir()) and not force:
            raise UserError(Problem("exists and is not empty (--force replaces it)", file=where, key="-o"))


def _remove_stale_staging(target: Path) -> None:
    """Staging directories of exports to the same place that died (their pid is gone)."""

    for p in target.parent.glob(f".{target.name}{_STAGING}*"):
        m = re.search(re.escape(_STAGING) + r"(?:old-)?(\d+)-", p.name)
        if m and not is_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _put_in_place(staging: Path, target: Path, *, force: bool) -> None:

    if target.is_dir() and any(target.iterdir()):
        if not force:  # appeared while we were exporting
            raise UserError(Problem("appeared and is not empty (--force replaces it)", file=str(target), key="-o"))
        aside = target.parent / f".{target.name}{_STAGING}old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(target, aside)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(aside, target)
            raise
        _fsync_path(target.parent, directory=True)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staging, target)  # replaces an empty directory in one step
    _fsync_path(target.parent, directory=True)


# ------------------------------------------------------------------------------------------------- writing


def _write(
    staging: Path, source: Source, facts: RunFacts, kind: str, dtype: str, max_bytes: int
) -> tuple[list[str], int, int]:

    tdtype = w.torch_dtype(dtype)
    if kind == "full":
        with _reader(source) as reader:
            written = w.write_model(staging, reader.entries, tdtype, max_bytes, after_each=reader.release)
        _copy_config(staging, source.path if (source.path / "config.json").is_file() else _base_dir(facts), dtype)
        _copy_tokenizer(staging, source, facts)
        return written.files + ([written.index] if written.index else []), written.tensors, written.bytes

    assert source.adapter_config is not None
    with _reader(source) as reader:
        live = source.layout != "hf"
        picked = [e for e in reader.entries if not live or e.name in reader.trainable]
        held = w.torch_dtype(facts.precision) if live and facts.precision != "fp32" else None
        adapter = adapter_entries(picked, live_names=live, held_as=held)
        if kind == "adapter":
            nbytes = w.write_safetensors(staging / "adapter_model.safetensors", adapter, tdtype)
            cfg = dict(source.adapter_config, base_model_name_or_path=facts.model_path, inference_mode=True)
            (staging / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            _copy_tokenizer(staging, source, facts)
            return ["adapter_model.safetensors", ADAPTER_CONFIG], len(adapter), nbytes
        base_dir = _base_dir(facts)
        with w.hf_reader(base_dir) as base:
            transform, merged = merge_transform(
                adapter, {e.name for e in base.entries}, lora_math(source.adapter_config)
            )
            written = w.write_model(
                staging, base.entries, tdtype, max_bytes, transform=transform, after_each=base.release
            )
    _copy_config(staging, base_dir, dtype)
    _copy_tokenizer(staging, source, facts)
    return written.files + ([written.index] if written.index else []), written.tensors, written.bytes


def _reader(source: Source) -> Reader:

    if source.layout == "zero":
        return w.zero_reader(source.path / str(source.tag), int(source.stage or 0))
    if source.layout == "universal":
        return w.universal_reader(source.path, str(source.universal_tag))
    if source.is_lora:
        return w.hf_reader(source.path, stem="adapter_model")
    return w.hf_reader(source.path)


def _base_dir(facts: RunFacts) -> Path:
    """The recipe's model as a local directory (a hub id through huggingface_hub's cache, as the ranks loaded it)."""
    path = Path(facts.model_path)
    if path.is_dir():
        return path
    if facts.model_revision is None:
        raise ExportRefused(f"{facts.model_path}: the run's base model directory is gone")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja"]
    return Path(snapshot_download(facts.model_path, revision=facts.model_revision, allow_patterns=patterns))


def _check_base(base_dir: Path, facts: RunFacts) -> None:
    """A merge into another base than the one trained on would verify (both sides use it) and still be wrong: every
    weight file is compared with the checkpoint's fingerprint, by content (the checksums a commit record uses)."""
    changed = changed_weights(base_dir, facts.model)
    if changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise ExportRefused(
            f"{changed[0]}{more}: the base model changed since training, merging into it would not give the "
            "trained model"
        )


def _copy_config(staging: Path, from_dir: Path, dtype: str) -> None:
    cfg = json.loads((from_dir / "config.json").read_text())
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
    cfg[key] = name
    (staging / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if (from_dir / "generation_config.json").is_file():
        shutil.copyfile(from_dir / "generation_config.json", staging / "generation_config.json")


def _copy_tokenizer(staging: Path, source: Source, facts: RunFacts) -> None:
    """The tokenizer HF Trainer saved with the checkpoint, else the run's tokenizer directory."""
    for d in (source.path, Path(facts.tokenizer_path)):
        found = [n for n in _TOKENIZER_FILES if (d / n).is_file()]
        if found:
            for n in found:
                shutil.copyfile(d / n, staging / n)
            return


def _finish(
    staging: Path,
    target: Path,
    source: Source,
    facts: RunFacts,
    kind: str,
    dtype: str,
    files: list[str],
    tensors: int,
    nbytes: int,
    max_bytes: int,
    seconds: float,
    peak: int | None,
    verdict: Verdict | None,
    commit_extra: CommitExtra | None,
) -> None:
    """Model card, export record and the export's own commit record (every file, checksummed)."""

    rec = card.record(
        source,
        facts,
        kind=kind,
        dtype=dtype,
        files=files,
        tensors=tensors,
        nbytes=nbytes,
        max_shard_bytes=max_bytes,
        seconds=seconds,
        peak_rss_bytes=peak,
        verdict=verdict,
    )
    (staging / card.RECORD).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    (staging / card.CARD).write_text(card.render(rec, str(target)))
    extra: CommitExtra = {
        "export": {
            "checkpoint": source.name,
            "step": source.step,
            "kind": kind,
            "dtype": dtype,
            "verified": None if verdict is None else verdict.ok,
        },
        "fingerprint": source.fingerprint,
        **(commit_extra or {}),
    }
    write_commit(
        staging,
        [_manifest(staging)],
        step=int(source.step or 0),
        world_size=source.world_size or 1,
        stage=source.stage,
        recipe_hash=facts.recipe_hash,
        kind="model",
        extra=extra,
    )


def _manifest(staging: Path) -> dict[str, FileEntry]:
    """The commit record's part for the export's files: fsync, size and XXH3-128 of each, read in chunks.

    Not :func:`ftkit.checkpoint.commit.manifest_part`, which hashes through ``mmap``: that maps the whole shard
    into the process, and a 5 GB output shard would put 5 GB into the export's resident set (reclaimable page cache, but
    counted), undoing the streaming.
    """

    out: dict[str, FileEntry] = {}
    for p in sorted(staging.rglob("*")):
        if p.is_file():
            _fsync_path(p)
            out[p.relative_to(staging).as_posix()] = {"size": p.stat().st_size, "checksum": full_checksum(p), "rank": 0}
    return out


# ------------------------------------------------------------------------------------------------- re-check


def verify_export(export_dir: str | os.PathLike[str], *, note: Callable[[str], None] = _silent) -> Verdict:
    """Re-check an earlier export: every file against its commit record (:class:`ExportTorn`, exit 13), the
    checkpoint it came from still committed and unchanged (:class:`ExportRefused`, exit 5), then the logits
    (:class:`ExportMismatch`, exit 15). Writes nothing."""

    d = Path(export_dir)
    if not d.is_dir():
        raise UserError(Problem("not a directory", file=str(export_dir), key="--verify"))
    rec = read_record(d)
    v = verify_checkpoint(d, checksums=True, require_commit=True)
    if not v.ok:
        raise ExportTorn(f"{export_dir}: {v.reason.split(': ', 1)[-1]}")
    note(f"files: {v.reason.split(': ', 1)[-1]}")
    src = rec["source"]
    source = resolve(
        src["run_dir"], FINAL if src["checkpoint"] == FINAL else src["step"], universal=src.get("layout") == "universal"
    )
    was, now = (src.get("commit") or {}).get("created_utc"), source.record.get("created_utc")
    if was != now:
        raise ExportRefused(
            f"{source.name} was committed again at {now} after this export read it (committed {was}): "
            "it is not the checkpoint this directory came from"
        )
    note(f"source: {source.reason}")
    exp = rec["export"]
    verdict = prove(d, source, run_facts(source), exp["kind"], exp["dtype"])
    _say(verdict, note)
    if not verdict.ok:
        raise ExportMismatch(f"{export_dir}: {verdict.summary()}")
    return verdict


def _say(verdict: Verdict, note: Callable[[str], None]) -> None:
    if len(verdict.checks) > 1:
        for check in verdict.checks:
            note(f"  {check.line()}")
    note(verdict.summary())


# ------------------------------------------------------------------------------------------------- memory


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, so a phase's own peak can be read after it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None
