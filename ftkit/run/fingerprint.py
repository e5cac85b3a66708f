"""What shapes a run, recorded with every checkpoint and compared when a run resumes.

:func:`compute` (head node, stdlib + ``xxhash``) returns a JSON-able fingerprint of everything that shapes training:
the resolved recipe values, the training data file's size and full-content hash (XXH3-128), the model's
``config.json`` hash, the weight files' sizes and checksums (XXH3-128 of every byte, as a commit record has them; a
file unchanged since the run's last launch keeps its checksum, :func:`weight_hashes`), the tokenizer files' hash, and
the versions of ftkit and the training
libraries (read with ``importlib.metadata``; none of them is imported). ``ftkit launch`` puts it in the run spec
and rank 0 copies it into the ``extra`` of every commit record (``ftkit_commit.json``).

:func:`compare` decides a resume: the checkpoint's recorded fingerprint against the one computed now. Each
difference is one :class:`Change` with one of four verdicts:

* ``safe``: applied and listed. These keys do not change what a resumed optimizer step computes.
* ``allowed``: not safe, but named in ``--allow-changes``: applied (some by the rank after the checkpoint is loaded,
  see :data:`RANK_APPLIED`) and listed.
* ``refused``: not safe and not allowed: the launch stops with exit 2, one line per difference.
* ``impossible``: cannot be applied to a resumed run at all; refused even when allowed, with the reason.

Changes of library versions are notes (reported, never refused); so is a checkpoint without a fingerprint (written
by an older ftkit): nothing can be compared, nothing is refused.

The policy, one table (:data:`POLICY`), one reason per group; a key in no group refuses unless allowed:

==============  ===================================================  =============================================
verdict         keys                                                 why
==============  ===================================================  =============================================
safe            train.max_steps, train.epochs                        how long to train, not how a step is computed
                                                                     (a decaying schedule is stretched to the new
                                                                     horizon from the current step on)
safe            train.save_steps, train.save_total_limit,            when checkpoints and losses are written
                train.logging_steps
safe            resilience.*                                         how the supervisor reacts to failures
safe            train.report_to                                      where metrics are reported
safe            name, cluster.engine, cluster.master_addr,           how processes are started and find each other
                cluster.master_port, cluster.ssh_config, cluster.env
safe            cluster.gpu_memory_gb, cluster.host_memory_gb        inputs to ftkit plan only; what it decides
                                                                     (stage, batch) is compared on its own
safe            model.gradient_checkpointing, zero.overlap_comm,     the same update, computed with other memory or
                zero.reduce_bucket_size, zero.allgather_bucket_size,  communication scheduling
                zero.nvme_path, the other zero.* buffer and bucket
                sizes
not compared    zero.stage, cluster.num_nodes, cluster.gpus_per_node, the job's shape: checked when the checkpoint is
                cluster.hostfile, cluster.min_nodes                  selected (a different ZeRO stage is refused;
                                                                     fewer ranks are resumed through DeepSpeed's
                                                                     universal checkpoint when ftkit shrinks a job)
not compared    train.output_dir                                     it is the run directory itself
impossible      parallel.tp, parallel.sp                             the checkpoint's layout and data order are the
                                                                     recorded layout's; not re-formed yet
allowable       train.learning_rate, train.weight_decay,             change the optimizer; the checkpoint restores
                train.adam_beta1, train.adam_beta2,                  its hyperparameters, so the rank re-applies the
                train.adam_epsilon                                   new ones after loading it
allowable       train.lr_scheduler, train.warmup_steps,              change the schedule; HF rebuilds its shape
                scheduler.* (DeepSpeed's schedules)                  from the current arguments (the checkpoint
                                                                     holds only its step and peak lr)
allowable       train.max_grad_norm                                  changes gradient clipping (ds_config)
allowable       train.fp16_*                                         changes fp16 loss scaling (which steps are
                                                                     skipped on overflow)
allowable       train.micro_batch_size                               changes the per-rank batch and accumulation
                                                                     (same global batch: same data position)
allowable       data.train (content), data.max_seq_len,              change the examples; the resumed epoch
                data.truncate, model.tokenizer (content)             continues at the same offset in the new data
allowable       peft.alpha, peft.dropout                             set when the model is built, not stored in
                                                                     the checkpoint
allowable       data.eval, train.eval_steps                          each evaluation draws a DataLoader seed from
                                                                     the global generator: dropout after it differs
allowable       train.command                                        another program may compute another step
allowable       zero.offload_optimizer, zero.offload_params,         change the optimizer implementation or the
                zero.cpu_adam, cluster.accelerator                   device (other kernels, other rounding)
impossible      model.path (config or weights differ)                the checkpoint holds weights for the recorded
                                                                     model
impossible      peft (on/off), peft.method, peft.r,                  the checkpoint's trainable weights have the
                peft.target_modules                                  recorded shapes
impossible      train.seed                                           data order and RNG state come from the
                                                                     checkpoint: a new seed would reshuffle the
                                                                     epoch mid-way (examples skipped or repeated)
impossible      train.global_batch_size                              the data position is counted in optimizer
                                                                     steps: another batch size skips or repeats
                                                                     examples
impossible      train.precision                                      DeepSpeed keeps precision-specific optimizer
                                                                     state (loss scaler, bf16 optimizer); ftkit
                                                                     does not convert it
==============  ===================================================  =============================================

``data.train``, ``model.path`` and ``model.tokenizer`` are compared by content: the same bytes at another path is
a safe change (listed as moved).
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit import __version__
from ftkit.checkpoint.checksums import full_checksum
from ftkit.cluster.pkgversions import versions as installed_versions
from ftkit.errors import Problem, UserError
from ftkit.model.config import config_source
from ftkit.recipe.schema import FIELD_BY_KEY
from ftkit.rundir.env import mask_items
from ftkit.rundir.layout import RunDir
from ftkit.rundir.records import JSON, Fingerprint

if TYPE_CHECKING:
    import xxhash

    from ftkit.plan.plan import Plan

FORMAT = 1
LIBRARIES = ("torch", "deepspeed", "transformers", "peft", "accelerate")
CHUNK = 8 << 20  # 8 MiB reads: large enough for full hash speed, small enough to stay in cache

SAFE, ALLOWABLE, IMPOSSIBLE, NOT_COMPARED = "safe", "allowable", "impossible", "not compared"

# (verdict, key patterns, reason). First match wins; a key matching no group is ALLOWABLE with DEFAULT_REASON.
POLICY: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        SAFE,
        ("train.max_steps", "train.epochs"),
        "step limit",
    ),
    (SAFE, ("train.save_steps", "train.save_total_limit", "train.logging_steps"), "save/log cadence"),
    (SAFE, ("resilience.*",), "restart policy and timeouts"),
    (SAFE, ("checkpoint.*",), "where and how often checkpoints are kept, not what they hold"),
    (SAFE, ("train.report_to",), "where metrics are reported, not how a step is computed"),
    (
        SAFE,
        ("name", "cluster.engine", "cluster.master_addr", "cluster.master_port", "cluster.ssh_config", "cluster.env"),
        "launch plumbing, not the math",
    ),
    (
        SAFE,
        (
            "cluster.gpu_memory_gb",
            "cluster.host_memory_gb",
            "cluster.gpu",
            "cluster.network",
            "cluster.intra_node_gbs",
            "cluster.inter_node_gbs",
        ),
        "planning input only",
    ),
    (
        SAFE,
        (
            "model.gradient_checkpointing",
            "zero.overlap_comm",
            "zero.reduce_bucket_size",
            "zero.allgather_bucket_size",
            "zero.nvme_path",
            "zero.contiguous_gradients",
            "zero.round_robin_gradients",
            "zero.pin_memory",
            "zero.sub_group_size",
            "zero.prefetch_bucket_size",
            "zero.param_persistence_threshold",
            "zero.max_live_parameters",
            "zero.max_reuse_distance",
        ),
        "same update, other memory or communication scheduling",
    ),
    (
        NOT_COMPARED,
        ("zero.stage", "cluster.num_nodes", "cluster.gpus_per_node", "cluster.hostfile", "cluster.min_nodes"),
        "job shape: checked when the checkpoint is selected",
    ),
    (NOT_COMPARED, ("train.output_dir",), "the run directory itself"),
    (
        NOT_COMPARED,
        ("model.revision", "model.config"),
        "compared through model.path's content: the resolved hub commit, config.json and weight files",
    ),
    (
        ALLOWABLE,
        ("train.learning_rate", "train.weight_decay", "train.adam_beta1", "train.adam_beta2", "train.adam_epsilon"),
        "changes the optimizer",
    ),
    (ALLOWABLE, ("train.lr_scheduler", "train.warmup_steps", "scheduler.*"), "changes the learning-rate schedule"),
    (ALLOWABLE, ("train.max_grad_norm",), "changes gradient clipping"),
    (ALLOWABLE, ("train.fp16_*",), "changes fp16 loss scaling: which steps are skipped on overflow"),
    (ALLOWABLE, ("train.micro_batch_size",), "changes the per-rank batch and gradient accumulation"),
    (
        ALLOWABLE,
        ("data.train", "data.max_seq_len", "data.truncate", "model.tokenizer"),
        "changes the training examples",
    ),
    (ALLOWABLE, ("peft.alpha", "peft.dropout"), "changes the LoRA adapters' forward pass"),
    (
        ALLOWABLE,
        ("data.eval", "train.eval_steps"),
        "changes the random stream: each evaluation draws a DataLoader seed from the global generator (dropout after)",
    ),
    (ALLOWABLE, ("train.command",), "another training program may compute another step"),
    (
        ALLOWABLE,
        ("zero.offload_optimizer", "zero.offload_params", "zero.cpu_adam", "cluster.accelerator"),
        "changes the optimizer implementation or device (other rounding)",
    ),
    (
        IMPOSSIBLE,
        ("model.path",),
        "the checkpoint holds weights for the recorded model; start a new run (another train.output_dir)",
    ),
    (
        IMPOSSIBLE,
        ("peft", "peft.method", "peft.r", "peft.target_modules"),
        "the checkpoint's trainable weights have the recorded shapes; start a new run",
    ),
    (
        IMPOSSIBLE,
        ("train.seed",),
        "data order and RNG state come from the checkpoint: a new seed would reshuffle the epoch mid-way",
    ),
    (
        IMPOSSIBLE,
        ("train.global_batch_size",),
        "the data position counts optimizer steps: another global batch would skip or repeat examples",
    ),
    (
        IMPOSSIBLE,
        ("train.precision",),
        "DeepSpeed's optimizer state is precision-specific and ftkit does not convert it",
    ),
    (
        IMPOSSIBLE,
        ("train.backend", "fsdp.state_dict_type"),
        "the checkpoint's layout is the recorded backend's (DeepSpeed's ZeRO files, FSDP2's sharded or full state "
        "dict) and ftkit does not convert it; start a new run",
    ),
    (
        ALLOWABLE,
        ("fsdp.offload_params",),
        "changes the optimizer's device (other rounding)",
    ),
    (
        SAFE,
        ("fsdp.reshard_after_forward", "fsdp.transformer_layer_cls", "fsdp.cpu_ram_efficient_loading"),
        "same update, other memory or communication scheduling",
    ),
    (
        IMPOSSIBLE,
        ("parallel.tp", "parallel.sp"),
        "the checkpoint was saved by the recorded tensor/sequence-parallel layout (AutoTP's or FSDP2's split "
        "weights, the data order of its data-parallel ranks) and ftkit does not re-form it yet; start a new run",
    ),
)
DEFAULT_REASON = "not known to be safe"

# Keys compared by the content they point at (the "data", "model", "tokenizer" parts), not by their spelling.
CONTENT_KEYS = ("data.train", "model.path", "model.tokenizer")
PSEUDO_KEYS = ("peft",)  # the peft section as a whole: on or off

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json")


def policy(key: str) -> tuple[str, str]:
    """(verdict, reason) for a dotted recipe key."""
    for verdict, patterns, reason in POLICY:
        if any(fnmatch.fnmatchcase(key, p) for p in patterns):
            return verdict, reason
    return ALLOWABLE, DEFAULT_REASON


# ---------------------------------------------------------------------------------------------------------------
# Computing


def _xxh3() -> xxhash.xxh3_128:
    import xxhash  # imported here: ranks read this module's tables without needing the hash library

    return xxhash.xxh3_128()


def _update_file(h: xxhash.xxh3_128, path: Path) -> int:
    """Feed the whole file into ``h``; return its size in bytes."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n
            h.update(view[:k])
            n += k


def hash_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size, XXH3-128 hex digest) of a file's whole content."""
    h = _xxh3()
    size = _update_file(h, Path(path))
    return size, h.hexdigest()


def _data_part(path: str | None) -> dict[str, JSON]:
    out: dict[str, JSON] = {"path": path}
    if not path:
        return out
    p = Path(path)
    try:
        if p.is_dir():  # several files: names and contents, in a stable order
            h, size = _xxh3(), 0
            for f in sorted(x for x in p.rglob("*") if x.is_file()):
                h.update(str(f.relative_to(p)).encode() + b"\0")
                size += _update_file(h, f)
            out.update(size=size, xxh3_128=h.hexdigest())
        else:
            size, digest = hash_file(p)
            out.update(size=size, xxh3_128=digest)
    except OSError as e:  # the launch's own data check reports it with the fix; here it is just "different"
        out["error"] = e.strerror or str(e)
    return out


def _files_hash(directory: Path, names: Iterable[str]) -> str | None:
    h, any_file = _xxh3(), False
    for name in names:
        f = directory / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            _update_file(h, f)
            any_file = True
    return h.hexdigest() if any_file else None


def _model_part(
    path: str | None, config_file: str = "", revision: str | None = None, previous: Mapping[str, JSON] | None = None
) -> dict[str, JSON]:
    """``config_file``: the config.json the plan read (the hub cache's for a hub id, or model.config); the weights
    are looked for beside it (a hub snapshot directory) or in the model directory, and hashed (:func:`weight_hashes`;
    ``previous``: the model part of the run's last fingerprint, whose hashes of unchanged files are kept)."""
    out: dict[str, JSON] = {"path": path}
    if revision is not None:
        out["revision"] = revision
    local = Path(path) if path and Path(path).is_dir() else None  # the model directory, when it is one here
    cfg = Path(config_file) if config_file else (local / "config.json" if local is not None else None)
    if cfg is None or not cfg.is_file():
        return out  # a hub id not resolved here: nothing cheap to look at
    d = local if local is not None else cfg.parent
    if local is None and cfg.parent.parent.name == "snapshots":
        out["commit"] = cfg.parent.name  # the hub cache's snapshots/<commit>/config.json
    try:
        h = _xxh3()
        h.update(b"config.json\0")  # the same hash as _files_hash(dir, ["config.json"]) for a model directory
        _update_file(h, cfg)
        out["config_xxh3_128"] = h.hexdigest()
        files = [
            f
            for f in sorted(d.iterdir())
            if f.is_file() and any(fnmatch.fnmatchcase(f.name, p) for p in WEIGHT_PATTERNS)
        ]
        out["weights"] = {f.name: f.stat().st_size for f in files}
        hashes, stats = weight_hashes(files, previous if (previous or {}).get("path") == path else None)
        out["weights_xxh3_128"], out["weights_stat"] = hashes, stats
    except OSError as e:
        out["error"] = e.strerror or str(e)
    return out


def _stat_key(st: os.stat_result) -> list[JSON]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def weight_hashes(
    files: Iterable[Path], previous: Mapping[str, JSON] | None = None
) -> tuple[dict[str, JSON], dict[str, JSON]]:
    """(name -> ``xxh3_128:<hex>``, the checksum a commit record gives a file; name -> its stat key) of the base
    model's weight files. Every byte is read, unless ``previous`` (the model part of the run's last fingerprint)
    holds the hash of the very same file: same size, mtime, inode and device, and the same ctime, which no write
    and no ``touch`` leaves as it was. So only the first launch of a run reads the weights."""
    old_hashes = (previous or {}).get("weights_xxh3_128")
    old_stats = (previous or {}).get("weights_stat")
    hashes: dict[str, JSON] = {}
    stats: dict[str, JSON] = {}
    for f in files:
        key = _stat_key(f.stat())
        was = old_hashes.get(f.name) if isinstance(old_hashes, dict) else None
        if isinstance(was, str) and isinstance(old_stats, dict) and old_stats.get(f.name) == key:
            hashes[f.name] = was
        else:
            hashes[f.name] = full_checksum(f)
            key = _stat_key(f.stat())  # as it was read
        stats[f.name] = key
    return hashes, stats


def changed_weights(directory: Path, recorded: Mapping[str, JSON]) -> list[str]:
    """The base model's weight files in ``directory`` that differ from the fingerprint's model part ``recorded``
    (one phrase each: missing, another size, other content). Content is compared when the fingerprint has its
    checksums (every byte read now), else sizes (fingerprints of an older ftkit)."""
    out = []
    sizes = recorded.get("weights")
    hashes = recorded.get("weights_xxh3_128")
    for name, size in (sizes if isinstance(sizes, dict) else {}).items():
        f = directory / name
        try:
            now = f.stat().st_size
        except OSError:
            out.append(f"{f}: missing (the run trained on {size} bytes)")
            continue
        if now != size:
            out.append(f"{f}: {now} bytes, the run trained on {size}")
            continue
        was = hashes.get(name) if isinstance(hashes, dict) else None
        if isinstance(was, str) and full_checksum(f) != was:
            out.append(f"{f}: same size, other content ({was} when the run trained on it)")
    return out


def _actual_config_file(plan: Plan) -> str:
    """The config.json the ranks will load: the plan's, unless that is a checked-in copy (model.config), then
    the model's own where it can be resolved here."""
    r = plan.recipe
    file = getattr(plan, "model_config_file", "") or ""
    if r.model.config and r.model.path:
        try:
            return config_source(r.model, base=r.base_dir, checked_in=False).file
        except UserError:
            return file
    return file


def _tokenizer_part(path: str | None) -> dict[str, JSON]:
    out: dict[str, JSON] = {"path": path}
    if path and Path(path).is_dir():
        try:
            out["xxh3_128"] = _files_hash(Path(path), TOKENIZER_FILES)
        except OSError as e:
            out["error"] = e.strerror or str(e)
    return out


def versions() -> dict[str, str | None]:
    found = installed_versions(LIBRARIES)
    return {"ftkit": __version__, **{n: None if found[n] == "missing" else found[n] for n in LIBRARIES}}


def _jsonable(value: object) -> JSON:
    """``value`` as it reads back from a JSON file (tuples as lists, other objects as their str)."""
    out: JSON = json.loads(json.dumps(value, default=str))
    return out


def _previous_model(output_dir: str) -> Mapping[str, JSON] | None:
    """The model part of the fingerprint the run's last launch recorded (``ftkit/spec.json``), None without one."""
    try:
        spec = json.loads(RunDir(output_dir).spec.read_text())
        model = spec["fingerprint"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return model if isinstance(model, dict) else None


def compute(plan: Plan) -> Fingerprint:
    """The fingerprint of ``plan`` (a :class:`ftkit.plan.plan.Plan`; only ``plan.recipe`` is read). JSON-able."""
    t0 = time.perf_counter()
    r = plan.recipe
    has_peft = bool(getattr(r, "has_peft", False))
    recipe = {k: (v if has_peft or not k.startswith("peft.") else None) for k, v in r.values.items()}
    env = recipe.get("cluster.env")
    if isinstance(env, list):  # secrets never reach a record
        recipe["cluster.env"] = mask_items(env)
    model_path = r.model.path
    fp: Fingerprint = {
        "format": FORMAT,
        "recipe": {k: _jsonable(v) for k, v in recipe.items()},
        "peft": has_peft,
        "data": _data_part(r.data.train),
        "model": _model_part(
            model_path, _actual_config_file(plan), r.model.revision, _previous_model(r.train.output_dir)
        ),
        "tokenizer": _tokenizer_part(r.model.tokenizer or model_path),
        "versions": versions(),
    }
    fp["seconds"] = round(time.perf_counter() - t0, 4)
    return fp


# ---------------------------------------------------------------------------------------------------------------
# Comparing


@dataclass(frozen=True)
class Change:
    """One difference between the checkpoint's fingerprint and the current one."""

    key: str  # dotted recipe key (or "peft" for the section as a whole)
    old: JSON
    new: JSON
    verdict: str  # "safe", "allowed", "refused" or "impossible"
    reason: str
    what: str  # "0.0002 → 0.0001", "content changed (path, 1234 → 1250 bytes)"

    def line(self) -> str:
        if self.verdict == "safe":
            tail = f"applied: {self.reason}"
        elif self.verdict == "allowed":
            tail = f"applied: {self.reason}, allowed by --allow-changes"
        elif self.verdict == "refused":
            tail = f"refused: {self.reason}; pass --allow-changes {self.key} to apply it"
        else:
            tail = f"refused, cannot be applied to a resumed run: {self.reason}"
        return f"{self.key}: {self.what} ({tail})"

    def to_json(self) -> dict[str, JSON]:
        return {"key": self.key, "old": self.old, "new": self.new, "verdict": self.verdict, "reason": self.reason}


class ResumeRefused(UserError):
    """Resuming would silently change the run: one problem per refused change (exit 2)."""


@dataclass
class ResumeCheck:
    applied: list[Change] = field(default_factory=list)  # safe ones, and unsafe ones named in allow
    refused: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused

    def lines(self) -> list[str]:
        """One human line per change, applied first, then refused."""
        return [c.line() for c in self.applied + self.refused]

    def overrides(self) -> dict[str, JSON]:
        """Allowed (unsafe) recipe changes, dotted key → new value: the spec's ``resume_overrides``."""
        return {c.key: c.new for c in self.applied if c.verdict == "allowed" and c.key in FIELD_BY_KEY}

    def raise_if_refused(self) -> None:
        if self.refused:
            raise ResumeRefused([Problem(c.line()) for c in self.refused])


def _fmt(value: JSON) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(value)


def _check_allow(allow: Iterable[str]) -> set[str]:
    names = {a.strip() for a in allow if a and a.strip()}
    known = set(FIELD_BY_KEY) | set(PSEUDO_KEYS)
    unknown = sorted(names - known)
    if unknown:
        problems = []
        for k in unknown:
            close = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(
                Problem(
                    f"unknown recipe key {k!r}{hint}; name keys as in the recipe, e.g. train.learning_rate",
                    key="--allow-changes",
                )
            )
        raise UserError(problems)
    return names


def _content_change(key: str, old: Mapping[str, JSON], new: Mapping[str, JSON]) -> tuple[str, bool] | None:
    """(description, moved_only) when the content part differs; None when equal."""
    if key == "data.train":
        same = old.get("xxh3_128") == new.get("xxh3_128") and old.get("size") == new.get("size")
        same = same and not new.get("error") and old.get("xxh3_128") is not None
        if same:
            return (
                (f"moved, same content ({old.get('path')} → {new.get('path')})", True)
                if (old.get("path") != new.get("path"))
                else None
            )
        if new.get("error"):
            return f"cannot read {new.get('path')}: {new['error']}", False
        if old.get("path") != new.get("path"):
            return f"another file ({old.get('path')} → {new.get('path')}, different content)", False
        return f"content changed ({new.get('path')}, {old.get('size')} → {new.get('size')} bytes)", False
    if key == "model.path":
        fields = ["config_xxh3_128", "weights", "commit"]
        if "weights_xxh3_128" in old and "weights_xxh3_128" in new:  # content: an older ftkit recorded sizes only
            fields.append("weights_xxh3_128")
        if all(old.get(f) == new.get(f) for f in fields) and not new.get("error"):
            return (
                (f"moved, same config and weight files ({old.get('path')} → {new.get('path')})", True)
                if (old.get("path") != new.get("path"))
                else None
            )
        what = (
            "config.json"
            if old.get("config_xxh3_128") != new.get("config_xxh3_128")
            else f"hub commit ({old.get('commit')} → {new.get('commit')})"
            if old.get("commit") != new.get("commit")
            else "weight files"
        )
        return f"{what} changed ({old.get('path')} → {new.get('path')})", False
    # model.tokenizer
    if old.get("xxh3_128") == new.get("xxh3_128") and not new.get("error"):
        return (
            (f"moved, same files ({old.get('path')} → {new.get('path')})", True)
            if (old.get("path") != new.get("path"))
            else None
        )
    return f"tokenizer files changed ({old.get('path')} → {new.get('path')})", False


def compare(recorded: Fingerprint | None, current: Fingerprint, allow: Iterable[str] = ()) -> ResumeCheck:
    """Compare the checkpoint's fingerprint with the current one; ``allow`` names unsafe keys to apply anyway.

    Raises :class:`UserError` when ``allow`` names a key that is not a recipe key. Never raises for differences:
    the caller decides (``check.raise_if_refused()`` gives exit 2 with one line per refused change).
    """
    allowed = _check_allow(allow)
    check = ResumeCheck()
    if not recorded:
        check.notes.append(
            "the checkpoint has no fingerprint (written by an older ftkit): changes since it was saved are not checked"
        )
        return check
    if recorded.get("format") != FORMAT:
        check.notes.append(f"fingerprint format {recorded.get('format')} (this ftkit writes {FORMAT}): compared as is")

    def decide(key: str, old: JSON, new: JSON, what: str, safe_reason: str | None = None) -> None:
        verdict, reason = policy(key)
        if safe_reason is not None:
            verdict, reason = SAFE, safe_reason
        if verdict == NOT_COMPARED:
            return
        if verdict == SAFE:
            check.applied.append(Change(key, old, new, "safe", reason, what))
        elif verdict == IMPOSSIBLE:
            check.refused.append(Change(key, old, new, "impossible", reason, what))
        elif key in allowed:
            check.applied.append(Change(key, old, new, "allowed", reason, what))
        else:
            check.refused.append(Change(key, old, new, "refused", reason, what))

    old_r: Mapping[str, JSON] = recorded.get("recipe") or {}
    new_r: Mapping[str, JSON] = {k: _jsonable(v) for k, v in (current.get("recipe") or {}).items()}
    if bool(recorded.get("peft")) != bool(current.get("peft")):
        on = {True: "on", False: "off"}
        o, n = bool(recorded.get("peft")), bool(current.get("peft"))
        decide("peft", o, n, f"LoRA {on[o]} → {on[n]}")
    peft_both = bool(recorded.get("peft")) and bool(current.get("peft"))
    for key in sorted(set(old_r) | set(new_r)):
        if key in CONTENT_KEYS or (key.startswith("peft.") and not peft_both):
            continue
        if key not in old_r:
            check.notes.append(f"{key}: not recorded in the checkpoint (older ftkit), not compared")
            continue
        if key not in new_r:
            continue  # a key this ftkit no longer has
        was, now = old_r[key], new_r[key]
        if was != now:
            decide(key, was, now, f"{_fmt(was)} → {_fmt(now)}")
    parts = {"data.train": "data", "model.path": "model", "model.tokenizer": "tokenizer"}
    for key, part in parts.items():
        old_p, new_p = recorded.get(part), current.get(part)
        if not isinstance(old_p, dict) or not isinstance(new_p, dict):
            continue
        diff = _content_change(key, old_p, new_p)
        if diff is None:
            continue
        what, moved = diff
        decide(key, old_p.get("path"), new_p.get("path"), what, safe_reason="same content" if moved else None)
    old_v: Mapping[str, str | None] = recorded.get("versions") or {}
    new_v: Mapping[str, str | None] = current.get("versions") or {}
    for name in sorted(set(old_v) | set(new_v)):
        if old_v.get(name) != new_v.get(name):
            check.notes.append(
                f"{name} {_fmt(old_v.get(name))} → {_fmt(new_v.get(name))} since the checkpoint was saved "
                "(reported, not refused)"
            )
    return check
