"""What crosses from the controller to the ranks, as one typed structure both sides import.

``ftkit launch`` writes a :class:`RunSpec` to ``RUN/ftkit/spec.json`` (:func:`ftkit.run.spec.build_spec`); every rank
reads it back with :meth:`RunSpec.read` (:mod:`ftkit.hf`). Field names are attributes, not string keys: a renamed
field fails a type check (mypy/pyright) and, at run time, :meth:`RunSpec.from_dict` refuses a file whose fields
differ from this class with one line naming them, instead of a ``KeyError`` deep inside a rank.

Import-light: only the standard library (the ranks import it before torch).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftkit.errors import Problem, UserError


@dataclass(frozen=True)
class DataSpec:
    """The built-in entry's data (a wrapped script brings its own)."""

    train: str
    max_seq_len: int
    truncate: bool
    eval: str | None = None


@dataclass(frozen=True)
class RunSpec:
    ftkit_version: str
    name: str
    recipe: dict[str, Any]  # the resolved recipe, nested sections (recipe["train"]["seed"])
    recipe_hash: str
    world_size: int
    hosts: list[list[Any]]  # [[host, slots], ...] in hostfile order
    stage: int
    offload_optimizer: str
    offload_params: str
    accelerator: str
    model_path: str
    tokenizer_path: str
    model_revision: str | None  # a hub id's revision (main unless pinned); None for a local directory
    tokenizer_revision: str | None
    peft: dict[str, Any] | None
    data: DataSpec
    save_total_limit: int  # train.save_total_limit: an int of at least 1
    training_args: dict[str, Any]  # keyword arguments of transformers.TrainingArguments, from the plan
    fingerprint: dict[str, Any]
    resume_overrides: dict[str, Any] = field(default_factory=dict)
    command: list[str] | None = None  # the user's command run on every rank; None: the built-in entry
    # the training_args names the recipe states: applied to a wrapped script's own TrainingArguments (ftkit.hf)
    stated_args: list[str] = field(default_factory=list)
    # the local checkpoint tier (dir template with {host}, steps, keep, peer_copies, durable_steps, nodes, ssh_config);
    # None: every save goes to the run directory
    local_tier: dict[str, Any] | None = None

    # -------------------------------------------------------------------------------- recipe values ranks need

    def resilience(self, key: str, default: Any = None) -> Any:
        value = (self.recipe.get("resilience") or {}).get(key)
        return default if value is None else value

    @property
    def checksum(self) -> str:
        """resilience.checksum: full (every byte, the default) or sampled (opt-in for very large checkpoints)."""
        return str(self.resilience("checksum", "full"))

    @property
    def backend(self) -> str:
        """train.backend: deepspeed or fsdp2."""
        return str((self.recipe.get("train") or {}).get("backend") or "deepspeed")

    @property
    def precision(self) -> str:
        return str((self.recipe.get("train") or {}).get("precision") or "fp32")

    # -------------------------------------------------------------------------------- (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "spec.json") -> RunSpec:
        if not isinstance(d, dict):
            raise UserError(Problem("is not a JSON object; the run directory is damaged", file=where))
        names = {f.name for f in dataclasses.fields(cls)}
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        unknown, missing = sorted(set(d) - names), sorted(required - set(d))
        if unknown or missing:
            parts = [f"unknown field(s) {unknown}" if unknown else "", f"missing {missing}" if missing else ""]
            what = "; ".join(x for x in parts if x)
            raise UserError(
                Problem(f"{what}: written by another ftkit version? relaunch with this one to rewrite it", file=where)
            )
        data = d["data"]
        try:
            d = {**d, "data": data if isinstance(data, DataSpec) else DataSpec(**data)}
        except TypeError as e:
            raise UserError(Problem(f"data: {e}", file=where)) from None
        return cls(**d)

    @classmethod
    def read(cls, path: Path) -> RunSpec:
        try:
            d = json.loads(Path(path).read_text())
        except ValueError as e:
            raise UserError(Problem(f"does not parse as JSON ({e})", file=str(path))) from None
        return cls.from_dict(d, str(path))


# Allowed changes the rank applies itself after the checkpoint is loaded (HF and DeepSpeed restore these from the
# checkpoint's optimizer and scheduler state, overwriting the new TrainingArguments). Every other allowed change
# takes effect through the new spec: TrainingArguments, ds_config.json, the model and data built from it.
RANK_APPLIED = (
    "train.learning_rate",
    "train.weight_decay",
    "train.adam_beta1",
    "train.adam_beta2",
    "train.adam_epsilon",
)
