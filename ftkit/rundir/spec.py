"""What crosses from the controller to the ranks, as one typed structure both sides import.

``ftkit launch`` writes a :class:`RunSpec` to ``RUN/ftkit/spec.json`` (:func:`ftkit.run.make_spec.build_spec`); every
rank reads it back with :meth:`RunSpec.read` (:mod:`ftkit.hf`). Field names are attributes, not string keys: a renamed
field fails a type check (mypy/pyright) and, at run time, :meth:`RunSpec.from_dict` refuses a file whose fields
differ from this class with one line naming them, instead of a ``KeyError`` deep inside a rank.

The spec holds resolved, typed values only: what the plan decided (never ``auto``), each recipe value a rank needs
with its default already applied on the head node (:class:`ResilienceSection`, ``backend``, ``precision``, the local
tier). The rank reads attributes and restates no default. The recipe itself does not cross: the spec keeps only its
provenance (``recipe_hash`` and the ``fingerprint``); the resolved recipe is ``RUN/ftkit/recipe.json``, which the head
writes for the commands that read a run afterwards (the model card, ``ftkit plan --calibrate``) and no rank reads.

Import-light: only the standard library (the ranks import it before torch).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict, TypeVar

from ftkit.errors import Problem, UserError
from ftkit.rundir.records import JSON, Fingerprint, JSONObject
from ftkit.rundir.sections import ResilienceSection


class PeftSpec(TypedDict):
    """The recipe's ``peft`` section (LoRA), as the ranks build their adapters from it."""

    method: str
    r: int
    alpha: float
    dropout: float
    target_modules: list[str]


class ParallelSpec(TypedDict):
    """Tensor and sequence parallelism as the ranks set them up (the plan's resolved ``parallel`` section): the
    degrees, the data-parallel degree that alone multiplies the micro batch, which engine splits the layers, and the
    attention Ulysses wraps. The ranks build Accelerate's ParallelismConfig from it (TrainingArguments'
    ``parallelism_config``): ``accelerate launch`` also exports it from accelerate.yaml, the other launchers do not."""

    tp: int
    sp: int
    dp: int
    tp_engine: str  # "" (tp 1) | "deepspeed-autotp" (ds_config.json's tensor_parallel) | "fsdp2" (tp_size x FSDP2)
    sp_backend: str  # "" (sp 1) | "deepspeed" (ALST/Ulysses)
    sp_attn_implementation: str  # sdpa | flash_attention_2 | flash_attention_3 ("" with sp 1)


class LocalTierPlan(TypedDict):
    """The local checkpoint tier as the plan decided it (:meth:`ftkit.plan.local_tier.LocalTier.to_json`)."""

    dir: str  # a template: {host} becomes the node's name
    steps: int  # a local save every this many optimizer steps
    keep: int
    peer_copies: int
    bytes_per_node: int
    host_gb_per_node: float
    why: str


class LocalTierSpec(LocalTierPlan):
    """What the ranks and their agents need of the local checkpoint tier (:func:`ftkit.run.make_spec.local_tier_spec`):
    every key present, resolved on the head node."""

    durable_steps: int  # copies to the run directory: train.save_steps' cadence
    nodes: list[str]
    ssh_config: str | None


class TrainingArgs(TypedDict, total=False):
    """The keyword arguments of ``transformers.TrainingArguments`` ftkit states
    (:func:`ftkit.run.make_spec.training_arguments`)."""

    output_dir: str
    per_device_train_batch_size: int
    per_device_eval_batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    lr_scheduler_type: str
    warmup_steps: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    optim: str
    max_grad_norm: float
    logging_steps: int
    save_strategy: str
    save_steps: int
    save_total_limit: int | None
    save_on_each_node: bool
    seed: int
    data_seed: int
    bf16: bool
    fp16: bool
    deepspeed: str | None
    gradient_checkpointing: bool
    report_to: list[str]
    disable_tqdm: bool
    dataloader_num_workers: int
    remove_unused_columns: bool
    logging_first_step: bool
    save_only_model: bool
    include_num_input_tokens_seen: str
    eval_strategy: str
    eval_steps: int
    max_steps: int
    num_train_epochs: float | None
    use_cpu: bool
    ddp_backend: str


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
    recipe_hash: str  # the recipe's provenance, with the fingerprint's recipe part (ftkit/recipe.json: the recipe)
    world_size: int
    hosts: list[list[str | int]]  # [[host, slots], ...] in hostfile order
    stage: int
    offload_optimizer: str
    offload_params: str
    accelerator: str
    backend: str  # train.backend as the plan chose it: deepspeed or fsdp2 (never auto)
    precision: str  # train.precision: fp32, bf16 or fp16
    resilience: ResilienceSection  # every resilience.* value, defaults applied (the ranks: timeouts, checksum mode)
    model_path: str
    tokenizer_path: str
    model_revision: str | None  # a hub id's revision (main unless pinned); None for a local directory
    tokenizer_revision: str | None
    peft: PeftSpec | None
    data: DataSpec
    save_total_limit: int  # train.save_total_limit: an int of at least 1
    training_args: TrainingArgs  # keyword arguments of transformers.TrainingArguments, from the plan
    fingerprint: Fingerprint
    resume_overrides: dict[str, JSON] = field(default_factory=dict)  # dotted recipe key -> allowed new value
    command: list[str] | None = None  # the user's command run on every rank; None: the built-in entry
    # the training_args names the recipe states: applied to a wrapped script's own TrainingArguments (ftkit.hf)
    stated_args: list[str] = field(default_factory=list)
    # the local checkpoint tier (dir template with {host}, steps, keep, peer_copies, durable_steps, nodes, ssh_config);
    # None: every save goes to the run directory
    local_tier: LocalTierSpec | None = None
    # tensor/sequence parallelism (parallel.tp, parallel.sp); None: data parallelism alone (and the key is left out of
    # spec.json, so such a spec reads as before the field existed)
    parallel: ParallelSpec | None = None

    # -------------------------------------------------------------------------------- (de)serialisation

    def to_dict(self) -> JSONObject:
        out = dataclasses.asdict(self)
        if out.get("parallel") is None:
            out.pop("parallel", None)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str) + "\n"

    @classmethod
    def from_dict(cls, d: object, where: str = "spec.json") -> RunSpec:
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
        d = {
            **d,
            "data": _typed(DataSpec, d["data"], "data", where),
            "resilience": _typed(ResilienceSection, d["resilience"], "resilience", where),
        }
        tier = d.get("local_tier")
        if isinstance(tier, dict):
            missing_keys = sorted(set(LocalTierSpec.__required_keys__) - set(tier))
            if missing_keys:
                raise UserError(Problem(f"local_tier: missing {missing_keys}", file=where))
        return cls(**d)

    @classmethod
    def read(cls, path: Path) -> RunSpec:
        try:
            d = json.loads(Path(path).read_text())
        except ValueError as e:
            raise UserError(Problem(f"does not parse as JSON ({e})", file=str(path))) from None
        return cls.from_dict(d, str(path))


_Record = TypeVar("_Record", DataSpec, ResilienceSection)


def _typed(cls: type[_Record], value: object, name: str, where: str) -> _Record:
    """``value`` (a JSON object) as the frozen record ``cls``; one line naming ``name`` when the fields differ."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise UserError(Problem(f"{name}: is not a JSON object; the run directory is damaged", file=where))
    try:
        return cls(**value)
    except TypeError as e:
        raise UserError(Problem(f"{name}: {e}", file=where)) from None


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
