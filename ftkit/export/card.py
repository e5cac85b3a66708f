"""The export's model card (``README.md``) and its machine-readable twin (``ftkit_export.json``).

The card says where the weights came from precisely enough to trust them: the run, the checkpoint and its commit
record (step, when, how many files verified and how), the layout read, the training fingerprint (data, model
config and tokenizer hashes, library versions), the resolved recipe, the export's own settings and versions, and
the logits verdict. ``ftkit_export.json`` holds the same as data; ``ftkit export --verify DIR`` reads it to find
the checkpoint again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict, cast

from ftkit import __version__
from ftkit.cluster.pkgversions import versions
from ftkit.errors import Problem, UserError
from ftkit.export.logits import FP32_ATOL, Verdict, VerdictRecord
from ftkit.export.source import RunFacts, Source
from ftkit.export.weights import human
from ftkit.rundir.records import Fingerprint, JSONObject

CARD = "README.md"
RECORD = "ftkit_export.json"
RECORD_FORMAT = "ftkit-export"
RECORD_VERSION = 1


class ExportSource(TypedDict):
    """``ftkit_export.json``'s ``source``: the checkpoint read, and its commit record's facts."""

    run_dir: str
    checkpoint: str  # checkpoint-N or final
    step: int | None
    layout: str
    stage: int | None
    tag: str | None
    universal_tag: str | None
    read: str
    verified: str
    commit: dict[str, object]  # the commit record's step, created_utc, world_size, ..., and its number of files


class ExportRun(TypedDict):
    """``ftkit_export.json``'s ``run``: the run the checkpoint belongs to."""

    name: str
    model: str
    model_revision: str | None
    precision: str
    recipe_hash: str
    recipe: JSONObject
    fingerprint: Fingerprint  # the checkpoint's training fingerprint, less its recipe


class ExportInfo(TypedDict):
    """``ftkit_export.json``'s ``export``: what was written and how."""

    kind: str  # full | merged | adapter
    dtype: str  # fp32 | bf16 | fp16
    files: list[str]
    tensors: int
    bytes: int
    max_shard_bytes: int
    seconds: float
    peak_rss_bytes: int | None
    ftkit_version: str
    versions: dict[str, str]  # package -> version at export


class ExportRecord(TypedDict):
    """``ftkit_export.json``: what was exported from where, how, and the verdict."""

    format: str
    version: int
    source: ExportSource
    run: ExportRun
    export: ExportInfo
    verdict: VerdictRecord | None


def record(
    source: Source,
    facts: RunFacts,
    *,
    kind: str,
    dtype: str,
    files: list[str],
    tensors: int,
    nbytes: int,
    max_shard_bytes: int,
    seconds: float,
    peak_rss_bytes: int | None,
    verdict: Verdict | None,
) -> ExportRecord:
    """``ftkit_export.json``: what was exported from where, how, and the verdict."""
    commit: dict[str, object] = {
        k: source.record.get(k)
        for k in (
            "step",
            "created_utc",
            "world_size",
            "stage",
            "recipe_hash",
            "tag",
            "kind",
            "ftkit_version",
            "checksum",
        )
    }
    commit["files"] = len(source.record.get("files") or {})
    return {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "source": {
            "run_dir": str(source.run_dir.resolve()),
            "checkpoint": source.name,
            "step": source.step,
            "layout": source.layout,
            "stage": source.stage,
            "tag": source.tag,
            "universal_tag": source.universal_tag,
            "read": source.describe(),
            "verified": source.reason,
            "commit": commit,
        },
        "run": {
            "name": facts.name,
            "model": facts.model_path,
            "model_revision": facts.model_revision,
            "precision": facts.precision,
            "recipe_hash": facts.recipe_hash,
            "recipe": facts.recipe,
            "fingerprint": cast(Fingerprint, {k: v for k, v in source.fingerprint.items() if k != "recipe"}),
        },
        "export": {
            "kind": kind,
            "dtype": dtype,
            "files": files,
            "tensors": tensors,
            "bytes": nbytes,
            "max_shard_bytes": max_shard_bytes,
            "seconds": seconds,
            "peak_rss_bytes": peak_rss_bytes,
            "ftkit_version": __version__,
            "versions": {
                k: v for k, v in versions(("torch", "deepspeed", "transformers", "peft", "safetensors")).items()
            },
        },
        "verdict": verdict.to_json() if verdict is not None else None,
    }


def read_record(export_dir: Path) -> ExportRecord:

    path = export_dir / RECORD
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(Problem(f"no {RECORD}: not a directory ftkit export wrote", file=str(export_dir))) from None
    except (OSError, ValueError) as e:
        raise UserError(Problem(f"unreadable ({e})", file=str(path))) from None
    if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT or not isinstance(rec.get("source"), dict):
        raise UserError(Problem("not an ftkit export record", file=str(path)))
    return cast(ExportRecord, rec)


def _mb(n: int | None) -> str:

    return "n/a" if n is None else human(n)


def render(rec: ExportRecord, where: str) -> str:
    """README.md for the export at ``where`` (the path users will load it from)."""
    src, run, exp = rec["source"], rec["run"], rec["export"]
    commit = src["commit"]
    verdict = Verdict.from_json(v) if (v := rec.get("verdict")) else None
    adapter = exp["kind"] == "adapter"
    fp = run.get("fingerprint") or {}
    tags = ["ftkit", "fine-tuned"] + (["lora"] if exp["kind"] in ("adapter", "merged") else [])
    lines = [
        "---",
        f"library_name: {'peft' if adapter else 'transformers'}",
        f"base_model: {json.dumps(run['model'])}",
        f"tags: [{', '.join(tags)}]",
        "---",
        "",
        f"# {run['name']}: {src['checkpoint']} (step {src['step']})",
        "",
        f"Exported by `ftkit export` {exp['ftkit_version']} from `{src['run_dir']}/{src['checkpoint']}`: "
        + {
            "full": "the fine-tuned model",
            "merged": "the LoRA adapter merged into the base model",
            "adapter": "the LoRA adapter alone",
        }[exp["kind"]]
        + f", {exp['dtype']}, {len(exp['files'])} file(s), {exp['tensors']} tensors, {_mb(exp['bytes'])}.",
        "",
        "## Load it",
        "",
        "```python",
    ]
    if adapter:
        lines += [
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            f"base = AutoModelForCausalLM.from_pretrained({json.dumps(run['model'])})",
            f"model = PeftModel.from_pretrained(base, {json.dumps(where)})",
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"model = AutoModelForCausalLM.from_pretrained({json.dumps(where)})",
            f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(where)})",
        ]
    lines += ["```", "", "## Verification", ""]
    if verdict is None:
        lines += ["Not verified (exported with `--no-verify`); `ftkit export --verify DIR` checks it later.", ""]
    else:
        lines += [f"**{verdict.summary()}** ({verdict.verified_utc}, {verdict.seconds:g} s).", ""]
        lines += [f"- {c.line()} ({c.tokens} tokens)" for c in verdict.checks]
        lines += [
            "",
            f"The export was loaded with `from_pretrained` in float32 and its logits on a probe batch compared with "
            f"the checkpoint's training state loaded on an independent path. Tolerance: max |diff| <= {FP32_ATOL:g}; "
            "a bf16/fp16 export is compared with that state rounded to the same dtype (the rounding's own effect is "
            "reported, not judged).",
            "",
        ]
    lines += [
        "## Provenance",
        "",
        "| | |",
        "|---|---|",
        f"| run | `{src['run_dir']}` ({run['name']}) |",
        f"| checkpoint | `{src['checkpoint']}`, step {src['step']}, committed {commit.get('created_utc')} |",
        f"| verified before export | {src['verified']} |",
        f"| read | {src['read']} |",
        f"| commit record | world size {commit.get('world_size')}, "
        + (f"ZeRO stage {commit['stage']}, " if commit.get("stage") is not None else "not a ZeRO checkpoint, ")
        + f"{commit.get('files')} files, checksums {json.dumps(commit.get('checksum'))}, "
        f"written by ftkit {commit.get('ftkit_version')} |",
        f"| recipe hash | `{run['recipe_hash']}` |",
        f"| model | `{run['model']}`"
        + (f" (revision `{run['model_revision']}`)" if run.get("model_revision") else "")
        + f"; training precision {run['precision']} |",
    ]
    data, model, tok = fp.get("data") or {}, fp.get("model") or {}, fp.get("tokenizer") or {}
    if data:
        lines.append(f"| data | `{data.get('path')}`, {data.get('size')} bytes, xxh3_128 `{data.get('xxh3_128')}` |")
    if model.get("config_xxh3_128"):
        lines.append(f"| model config | xxh3_128 `{model.get('config_xxh3_128')}` |")
    if tok.get("xxh3_128"):
        lines.append(f"| tokenizer | `{tok.get('path')}`, xxh3_128 `{tok.get('xxh3_128')}` |")
    trained = fp.get("versions") or {}
    if trained:
        lines.append("| versions at training | " + ", ".join(f"{k} {v}" for k, v in trained.items() if v) + " |")
    lines.append(
        "| versions at export | "
        + ", ".join(f"{k} {v}" for k, v in {"ftkit": exp["ftkit_version"], **exp["versions"]}.items() if v)
        + " |"
    )
    lines.append(
        f"| export | {exp['kind']}, {exp['dtype']}, files {', '.join(exp['files'])}, max shard "
        f"{_mb(exp['max_shard_bytes'])}, {exp['seconds']:g} s, peak RSS {_mb(exp['peak_rss_bytes'])} |"
    )
    lines += ["", "## Recipe (resolved)", "", "```json", json.dumps(run["recipe"], indent=2, default=str), "```", ""]
    return "\n".join(lines)
