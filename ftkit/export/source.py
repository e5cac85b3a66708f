"""Which checkpoint an export reads, whether it may, and how its weights are laid out on disk.

Stdlib only (like :mod:`ftkit.checkpoint`): every refusal happens here, before torch is imported, so a torn
checkpoint is turned away in a fraction of a second and nothing is written.

A source is ``checkpoint-N`` (``--checkpoint N``), the newest committed one (``latest``) or the run's ``final/``
(``final``). Only a checkpoint whose commit record verifies, every byte against its checksum, is exported; any
other is refused with the verification's own reason (:class:`ftkit.errors.NoValidCheckpoint`, exit 5). The layout
is read from the directory and its commit record:

``zero``       DeepSpeed's ``global_stepN/`` shards (``latest`` names the tag); the stage comes from the commit
               record and is checked against the files (stage 3 writes per-rank model states). Parameter and
               optimizer offload leave the same files.
``universal``  DeepSpeed's universal checkpoint beside them (``latest_universal``), which ftkit writes when it
               continues a job on fewer hosts (:mod:`ftkit.supervise.universal`); read only when asked
               (``universal=True``): its files were written after the commit, so only the ZeRO shards are covered by the
               record.
``hf``         no DeepSpeed shards: the model files HF Trainer wrote (``final/``, or a run without DeepSpeed).
``fsdp``       a ``torch.distributed.checkpoint`` directory (FSDP2): refused (the run's ``final/`` is HF files).

A LoRA run is recognised by ``adapter_config.json`` in the source (HF Trainer saves the adapter there).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from ftkit.checkpoint.directory import list_checkpoints, select_resume
from ftkit.checkpoint.layout import COMMIT_FILE, LATEST
from ftkit.checkpoint.verify import verify
from ftkit.cluster.procs import is_alive
from ftkit.errors import ExitCode, FtkitError, NoValidCheckpoint, Problem, UserError
from ftkit.rundir.layout import RunDir
from ftkit.rundir.records import CommitRecord, Fingerprint, JSONObject
from ftkit.rundir.spec import RunSpec
from ftkit.supervise.universal import LATEST_UNIVERSAL

ADAPTER_CONFIG = "adapter_config.json"
FINAL = "final"
LATEST_CHOICE = "latest"
_FSDP_RE = re.compile(r"^pytorch_model_fsdp_\d+$")


class ExportRefused(NoValidCheckpoint):
    """The source cannot be exported (not committed, failing verification, or a layout export cannot read): exit 5."""


class CheckpointGone(FtkitError):
    """The run, still training, deleted the checkpoint (its rotation) before the export could hold it: not a damaged
    checkpoint (exit 11, the run directory belongs to a live job)."""

    exit_code = ExitCode.RUN_BUSY


@dataclass(frozen=True)
class Source:
    """One checkpoint an export reads: where, what verified it, and how its weights are stored."""

    run_dir: Path
    path: Path  # RUN/checkpoint-N or RUN/final
    step: int | None
    record: CommitRecord = field(repr=False)  # the commit record (verified)
    reason: str  # the verification's verdict line, e.g. "checkpoint-8: committed, 23 files verified (...)"
    layout: str  # zero | universal | hf
    stage: int | None  # ZeRO stage from the commit record (None: not a DeepSpeed checkpoint)
    tag: str | None  # DeepSpeed tag directory (global_stepN), for zero and universal (the original shards)
    universal_tag: str | None  # global_stepN_universal, when layout is universal
    adapter_config: JSONObject | None = field(default=None, repr=False)  # LoRA runs
    skipped: tuple[str, ...] = ()  # newer checkpoints passed over when choosing "latest", with their reasons

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def is_lora(self) -> bool:
        return self.adapter_config is not None

    @property
    def world_size(self) -> int | None:
        ws = self.record.get("world_size")
        return ws if isinstance(ws, int) else None

    @property
    def fingerprint(self) -> Fingerprint:
        fp = (self.record.get("extra") or {}).get("fingerprint")
        return fp if isinstance(fp, dict) else {}

    def describe(self) -> str:
        """One line: what is read, e.g. "ZeRO-2 shards of 2 ranks (global_step8)"."""
        if self.layout == "zero" and self.stage == 0:
            what = f"ZeRO-0 module states of {self.world_size} rank(s) ({self.tag}/)"
        elif self.layout == "zero":
            what = f"ZeRO-{self.stage} shards of {self.world_size} rank(s) ({self.tag}/)"
        elif self.layout == "universal":
            what = f"DeepSpeed universal checkpoint ({self.universal_tag}/, from {self.world_size} rank(s))"
        else:
            what = "adapter files (HF format)" if self.is_lora else "model files (HF format)"
        return what + (", LoRA" if self.is_lora else "")


def parse_choice(checkpoint: str | int | None) -> str | int | None:
    """``--checkpoint``'s value: a step number, ``latest``, ``final`` or None (final/ if committed, else latest)."""
    if checkpoint is None or isinstance(checkpoint, int):
        return checkpoint
    text = str(checkpoint).strip()
    if text in (LATEST_CHOICE, FINAL):
        return text
    m = re.fullmatch(r"(?:checkpoint-)?(\d+)", text)
    if not m:
        raise UserError(Problem(f"{checkpoint!r} is not a step number, 'latest' or 'final'", key="--checkpoint"))
    return int(m.group(1))


def check_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The run directory, or one line saying why it is not one (exit 2)."""
    path = Path(run_dir)
    if not path.exists():
        raise UserError(Problem("does not exist [give the run's train.output_dir]", file=str(run_dir)))
    if not path.is_dir():
        raise UserError(Problem("not a directory [give the run's train.output_dir]", file=str(run_dir)))
    if not RunDir(path).spec.is_file():
        raise UserError(Problem("not an ftkit run directory (no ftkit/spec.json)", file=str(run_dir)))
    return path


def resolve(
    run_dir: str | os.PathLike[str],
    checkpoint: str | int | None = None,
    *,
    universal: bool = False,
    checksums: bool = True,
) -> Source:
    """The source to export, verified; refuses (exit 5) with the verification's reason otherwise.

    ``checkpoint``: a step (``checkpoint-N``), ``"latest"`` (the newest checkpoint whose commit record verifies;
    newer torn ones are listed in ``Source.skipped``), ``"final"``, or None: ``final/`` when it is committed, else
    ``latest`` (a run that died before finishing has an uncommitted or no ``final/``). A committed ``final/`` or
    ``checkpoint-N`` that fails verification is always refused, never swapped for another one.
    """
    run = check_run_dir(run_dir)
    choice = parse_choice(checkpoint)
    skipped: list[str] = []
    final = RunDir(run).final
    if choice is None:
        choice = FINAL if (final / COMMIT_FILE).is_file() else LATEST_CHOICE
        if choice == LATEST_CHOICE and final.is_dir():
            skipped.append(f"{FINAL}: no commit record (the run did not finish its final save)")
    if choice == FINAL:
        path = final
        if not path.is_dir():
            raise ExportRefused(f"{run}: no {FINAL}/ (the run has not finished); use --checkpoint latest or N")
        v = verify(path, checksums, require_commit=True)
    elif choice == LATEST_CHOICE:
        sel = select_resume(run, checksums=checksums, require_commit=True)
        skipped += [v.reason for v in sel.rejected]
        if sel.chosen is None or sel.verdict is None:
            found = len(list_checkpoints(run))
            why = f"; {skipped[-1]}" if skipped else ""
            raise ExportRefused(f"{run}: no committed checkpoint to export ({found} checkpoint-N found){why}")
        path, v = sel.chosen, sel.verdict
    else:
        path = run / f"checkpoint-{choice}"
        if not path.is_dir():
            have = ", ".join(str(s) for s, _ in sorted(list_checkpoints(run))) or "none"
            raise ExportRefused(f"{run}: no checkpoint-{choice} (checkpoints: {have})")
        v = verify(path, checksums, require_commit=True)
    if not (v.ok and v.committed) or v.record is None:
        raise ExportRefused(f"{v.reason} [refusing to export it]")
    return _layout(run, path, v.step, v.record, v.reason, universal, tuple(skipped))


HOLD_PREFIX = ".ftkit-export-hold-"  # RUN/.ftkit-export-hold-<pid>-<hex>/checkpoint-N: an export's stable copy


def hold(source: Source) -> Source:
    """The same checkpoint, held against the run's rotation while it is exported: hard links of every file under
    ``RUN/.ftkit-export-hold-<pid>-<hex>/checkpoint-N/`` (the same file system: no byte is copied). A live run's
    rotation may delete ``checkpoint-N`` meanwhile; the export reads on from the links, which the rotation never
    touches. Raises :class:`CheckpointGone` when the checkpoint went before every file was linked (or was committed
    again: another checkpoint of that step). ``final/`` is never rotated: returned as it is, as is the source when
    the run directory cannot be written to (the export then reads in place). :func:`release` removes the hold."""
    if source.path.name == FINAL:
        return source
    root = source.run_dir / f"{HOLD_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(root, 0o700)
    except OSError:
        return source
    dst = root / source.path.name
    try:
        for here, _dirs, files in os.walk(source.path, onerror=_raise):
            into = dst / os.path.relpath(here, source.path)
            into.mkdir(exist_ok=True)
            for name in files:
                os.link(os.path.join(here, name), into / name, follow_symlinks=False)
        v = verify(dst, False, require_commit=True)  # every file of the record, linked whole
        same = v.record == source.record
        if not (v.ok and same):
            raise FileNotFoundError(v.reason)
    except OSError as e:
        shutil.rmtree(root, ignore_errors=True)
        if source.path.exists() and not isinstance(e, FileNotFoundError):
            raise ExportRefused(f"{source.name}: cannot hold it for the export ({e.strerror or e})") from None
        raise CheckpointGone(
            f"{source.name} was deleted by the run's checkpoint rotation (the run is still training) before the "
            "export could hold it; it was not damaged: export a newer one (--checkpoint latest)"
        ) from None
    return replace(source, path=dst)


def _raise(e: OSError) -> None:
    raise e


def unheld(source: Source) -> Source:
    """The source as the run names it (``RUN/checkpoint-N``), not its hold."""
    return (
        replace(source, path=source.run_dir / source.name)
        if source.path.parent.name.startswith(HOLD_PREFIX)
        else source
    )


def release(source: Source) -> None:
    """Remove :func:`hold`'s links (the checkpoint's data goes with them when the rotation deleted it)."""
    if source.path.parent.name.startswith(HOLD_PREFIX):
        shutil.rmtree(source.path.parent, ignore_errors=True)


def remove_stale_holds(run_dir: Path) -> None:
    """Holds of exports that died (their pid is gone on this host)."""
    for p in run_dir.glob(HOLD_PREFIX + "*"):
        m = re.match(re.escape(HOLD_PREFIX) + r"(\d+)-", p.name)
        if m and not is_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _layout(
    run: Path,
    path: Path,
    step: int | None,
    record: CommitRecord,
    reason: str,
    universal: bool,
    skipped: tuple[str, ...],
) -> Source:
    name = path.name
    if any(_FSDP_RE.match(p.name) for p in path.iterdir()) or any(path.glob("*/*.distcp")):
        # The place for FSDP2: read the DCP shards per tensor (torch.distributed.checkpoint's metadata has the
        # chunks) into weights.Entry readers, like the ZeRO readers do.
        raise ExportRefused(
            f"{name}: an FSDP2 (torch.distributed.checkpoint) checkpoint: ftkit export does not read those yet; "
            "export the run's final/ (an FSDP2 run writes it as HF files)"
        )
    adapter = _read_json(path / ADAPTER_CONFIG) if (path / ADAPTER_CONFIG).is_file() else None
    stage = record.get("stage")
    stage = stage if isinstance(stage, int) else None
    tag = record.get("tag") if isinstance(record.get("tag"), str) else None
    if tag is None and (path / LATEST).is_file():
        tag = (path / LATEST).read_text().strip() or None
    utag = None
    if universal:
        if not (path / LATEST_UNIVERSAL).is_file():
            raise ExportRefused(f"{name}: has no DeepSpeed universal checkpoint ({LATEST_UNIVERSAL} missing)")
        utag = (path / LATEST_UNIVERSAL).read_text().strip()
        if not utag or "/" in utag or not (path / utag / "zero").is_dir():
            raise ExportRefused(f"{name}: {LATEST_UNIVERSAL} names {utag!r}, which is not a universal checkpoint")
        layout = "universal"
    elif tag is not None:
        layout = "zero"
        if not (path / tag).is_dir():
            raise ExportRefused(f"{name}: {tag}/ missing")
        stage3_files = any((path / tag).glob("zero_pp_rank_*_mp_rank_*_model_states.pt"))
        if stage is None:
            stage = 3 if stage3_files else _stage_from_files(path / tag)
        elif stage3_files != (stage == 3):
            raise ExportRefused(f"{name}: commit record says ZeRO stage {stage} but {tag}/ holds the other layout")
    else:
        layout = "hf"
        if adapter is None and not _hf_weights(path):
            raise ExportRefused(f"{name}: no DeepSpeed shards and no model or adapter files: nothing to export")
    return Source(run, path, step, record, reason, layout, stage, tag, utag, adapter, skipped)


def _stage_from_files(tag_dir: Path) -> int:
    """Stage of a checkpoint whose commit record has none: 0 without optimizer shards, else 1/2 (read alike)."""
    return 2 if any(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")) else 0


def _hf_weights(path: Path) -> list[str]:
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    return [n for n in names if (path / n).is_file()]


def _read_json(path: Path) -> JSONObject:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportRefused(f"{path.parent.name}: {path.name} unreadable ({e})") from None
    if not isinstance(data, dict):
        raise ExportRefused(f"{path.parent.name}: {path.name} is not a JSON object")
    return data


@dataclass(frozen=True)
class RunFacts:
    """What the export needs from the run besides the checkpoint: the model it started from, the tokenizer,
    the training precision and the recipe (for the model card). Values recorded in the checkpoint's fingerprint
    (as they were when it was saved) win over ``ftkit/spec.json`` (as of the newest launch)."""

    name: str
    model_path: str
    model_revision: str | None
    tokenizer_path: str
    tokenizer_revision: str | None
    precision: str  # fp32 | bf16 | fp16
    recipe: JSONObject = field(repr=False)
    recipe_hash: str
    model: JSONObject = field(default_factory=dict, repr=False)  # the fingerprint's model part: weight sizes, checksums


def run_facts(source: Source) -> RunFacts:

    spec = RunSpec.read(RunDir(source.run_dir).spec)
    flat = flat if isinstance(flat := source.fingerprint.get("recipe"), dict) else {}
    model = model if isinstance(model := source.fingerprint.get("model"), dict) else {}
    return RunFacts(
        name=spec.name,
        model_path=str(flat.get("model.path") or spec.model_path),
        model_revision=cast("str | None", flat.get("model.revision", spec.model_revision))
        if flat
        else spec.model_revision,
        tokenizer_path=spec.tokenizer_path,
        tokenizer_revision=spec.tokenizer_revision,
        precision=str(flat.get("train.precision") or spec.precision),
        recipe=_read_json(RunDir(source.run_dir).recipe),
        recipe_hash=str(source.record.get("recipe_hash") or spec.recipe_hash),
        model=model,
    )
