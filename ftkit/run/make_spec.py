"""The run spec: everything a rank needs, computed once on the head node from the Plan and written to
``ftkit/spec.json`` in the run directory. The training entry builds TrainingArguments from it, so they hold the
same numbers as the rendered DeepSpeed config and HF Trainer's consistency check passes.
"""

from __future__ import annotations

from pathlib import Path

from ftkit import __version__
from ftkit.model.config import DEFAULT_REVISION, model_is_hub
from ftkit.plan.plan import Plan
from ftkit.recipe.schema import DEEPSPEED_SCHEDULES
from ftkit.render.accelerate import sp_attn_implementation
from ftkit.run.fingerprint import compute as compute_fingerprint
from ftkit.rundir.records import JSON, Fingerprint
from ftkit.rundir.sections import PeftSection
from ftkit.rundir.spec import DataSpec, LocalTierSpec, ParallelSpec, PeftSpec, RunSpec, TrainingArgs

# TrainingArguments a wrapped script always gets from the recipe (the recipe decides what it states: docs/design.md,
# Wrapping a user's script): the batch triple, precision, seed, save cadence, step limit, output directory, DeepSpeed
# config and device. The optimizer's values join them when the recipe states them explicitly (STATED_WHEN_EXPLICIT).
ALWAYS_STATED = (
    "output_dir",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "seed",
    "data_seed",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "max_steps",
    "num_train_epochs",
    "deepspeed",
    "use_cpu",
    "ddp_backend",
)
STATED_WHEN_EXPLICIT = {
    "learning_rate": "train.learning_rate",
    "lr_scheduler_type": "train.lr_scheduler",
    "warmup_steps": "train.warmup_steps",
    "weight_decay": "train.weight_decay",
    "adam_beta1": "train.adam_beta1",
    "adam_beta2": "train.adam_beta2",
    "adam_epsilon": "train.adam_epsilon",
    "max_grad_norm": "train.max_grad_norm",
    "logging_steps": "train.logging_steps",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "report_to": "train.report_to",
    "eval_steps": "train.eval_steps",
}


def training_arguments(plan: Plan, output_dir: str, ds_config_path: str) -> TrainingArgs:
    """Keyword arguments for ``transformers.TrainingArguments``, from the same plan as ds_config.json (under
    ``train.backend: fsdp2`` none, ``deepspeed`` None: Accelerate's FSDP plugin comes from accelerate.yaml's
    environment)."""
    r = plan.recipe
    precision = r.train.precision
    args: TrainingArgs = {
        "output_dir": output_dir,
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "learning_rate": r.train.learning_rate,
        "lr_scheduler_type": hf_scheduler_type(r.train.lr_scheduler),
        "warmup_steps": r.train.warmup_steps,
        "weight_decay": r.train.weight_decay,
        "adam_beta1": r.train.adam_beta1,
        "adam_beta2": r.train.adam_beta2,
        "adam_epsilon": r.train.adam_epsilon,
        # torch's fused AdamW, as ds_config.json's optimizer block has DeepSpeed build it (HF uses that block and
        # ignores optim under DeepSpeed; FSDP2 builds this one): nothing to compile (docs/design.md, Rendering rules)
        "optim": "adamw_torch_fused",
        "max_grad_norm": r.train.max_grad_norm,
        "logging_steps": r.train.logging_steps,
        "save_strategy": "steps",
        "save_steps": r.train.save_steps,
        "save_total_limit": None,  # ftkit rotates: HF's rotation would count torn checkpoints
        "seed": r.train.seed,
        "data_seed": r.train.seed,
        "bf16": precision == "bf16",
        "fp16": precision == "fp16",
        "deepspeed": ds_config_path,
        "gradient_checkpointing": r.model.gradient_checkpointing,
        "report_to": list(r.train.report_to),
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
        "logging_first_step": True,
        "save_only_model": False,
    }
    # tokens seen (non-padding input tokens: the attention mask summed, all tokens without one) in every log record: the
    # progress line's tokens/s. HF 5.x: "all" | "non_padding" | "no" (True means "all").
    args["include_num_input_tokens_seen"] = "non_padding"
    if r.data.eval is not None:
        args["eval_strategy"] = "steps"
        args["eval_steps"] = r.train.eval_steps or r.train.save_steps
        args["per_device_eval_batch_size"] = plan.micro_batch_size
    # TensorBoard's directory: transformers 5.x has no TrainingArguments.logging_dir any more; its TensorBoardCallback
    # reads TENSORBOARD_LOGGING_DIR (default <output_dir>/runs/<time>_<host>), see tensorboard_dir() below.
    if r.train.max_steps is not None:
        args["max_steps"] = r.train.max_steps
    else:
        args["num_train_epochs"] = r.train.epochs
    if r.train.backend == "fsdp2":  # stated, so a wrapped script's own --deepspeed does not switch FSDP2 off
        args["deepspeed"] = None
    if r.cluster.accelerator == "cpu":
        args["use_cpu"] = True
        args["ddp_backend"] = "gloo"
    if plan.local_tier is not None:  # the Trainer saves to the local tier, often; copies go to the run directory
        args["save_steps"] = plan.local_tier.steps
        if plan.num_nodes > 1:
            args["save_on_each_node"] = True  # every node holds the shared files of its own part
    return args


def hf_scheduler_type(schedule: str) -> str:
    """TrainingArguments' ``lr_scheduler_type`` for ``train.lr_scheduler``: HF's own name, or, for DeepSpeed's
    schedules (which HF does not know and never builds: ds_config.json's scheduler block is used instead, see
    transformers ``deepspeed_optim_sched``), ``constant``, which HF accepts and ignores there."""
    return "constant" if schedule in DEEPSPEED_SCHEDULES else schedule


def stated_arguments(plan: Plan, args: TrainingArgs) -> list[str]:
    """The names in ``args`` that a wrapped script's own TrainingArguments get from the recipe."""
    explicit: set[str] = getattr(plan.recipe, "explicit", set())
    names = [k for k in ALWAYS_STATED if k in args]
    names += [k for k, key in STATED_WHEN_EXPLICIT.items() if k in args and key in explicit]
    if "max_steps" not in args:  # epochs decide: a script's own max_steps (default -1) must not override them
        names.append("max_steps")
    return names


def build_spec(
    plan: Plan,
    run_dir: Path,
    ds_config_path: Path,
    *,
    fingerprint: Fingerprint | None = None,
    resume_overrides: dict[str, JSON] | None = None,
    command: list[str] | None = None,
) -> RunSpec:
    """The spec for ``plan``. ``fingerprint`` (computed here when not given: pass it to hash the data only once
    per launch) is what rank 0 records in every commit; ``resume_overrides`` (dotted recipe key → new value) are
    the allowed changes a resumed attempt applies after loading its checkpoint (see ftkit.run.fingerprint)."""
    r = plan.recipe
    targs = training_arguments(plan, str(run_dir), str(ds_config_path))
    if "max_steps" not in targs:
        targs["max_steps"] = -1
    command = command if command is not None else r.train.command
    return RunSpec(
        ftkit_version=__version__,
        name=r.name,
        recipe_hash=r.hash(),
        world_size=plan.world_size,
        hosts=[list(h) for h in plan.hosts],
        stage=plan.stage,
        offload_optimizer=plan.offload_optimizer,
        offload_params=plan.offload_params,
        accelerator=r.cluster.accelerator,
        backend=r.train.backend,  # the plan resolved auto: deepspeed or fsdp2
        precision=r.train.precision,
        resilience=r.resilience,
        model_path=r.model.path,
        tokenizer_path=r.model.tokenizer or r.model.path,
        # a hub id's revision (main unless pinned): the ranks call from_pretrained(id, revision=...); None: local
        model_revision=(r.model.revision or DEFAULT_REVISION) if model_is_hub(r.model) else None,
        tokenizer_revision=(r.model.revision or DEFAULT_REVISION)
        if model_is_hub(r.model) and not r.model.tokenizer
        else None,
        peft=_peft_spec(r.peft),
        data=DataSpec(
            train=r.data.train,
            max_seq_len=r.data.max_seq_len,
            truncate=r.data.truncate,
            eval=r.data.eval,
        ),
        save_total_limit=r.train.save_total_limit,
        training_args=targs,
        fingerprint=fingerprint if fingerprint is not None else compute_fingerprint(plan),
        resume_overrides=dict(resume_overrides or {}),
        command=list(command) if command else None,
        stated_args=stated_arguments(plan, targs),
        local_tier=local_tier_spec(plan),
        parallel=parallel_spec(plan),
    )


def parallel_spec(plan: Plan) -> ParallelSpec | None:
    """What the ranks need to set up tensor/sequence parallelism; None for data parallelism alone."""
    if plan.tp * plan.sp == 1:
        return None
    fsdp2 = plan.recipe.train.backend == "fsdp2"
    return ParallelSpec(
        tp=plan.tp,
        sp=plan.sp,
        dp=plan.dp_size,
        tp_engine=("fsdp2" if fsdp2 else "deepspeed-autotp") if plan.tp > 1 else "",
        sp_backend="deepspeed" if plan.sp > 1 else "",
        sp_attn_implementation=sp_attn_implementation(plan) if plan.sp > 1 else "",
    )


def _peft_spec(p: PeftSection | None) -> PeftSpec | None:
    if p is None:
        return None
    return PeftSpec(method=p.method, r=p.r, alpha=p.alpha, dropout=p.dropout, target_modules=list(p.target_modules))


def local_tier_spec(plan: Plan) -> LocalTierSpec | None:
    """What the ranks and their agents need of the local tier (ftkit.checkpoint.tiers), None when it is off."""
    tier = plan.local_tier
    if tier is None:
        return None
    r = plan.recipe
    out: LocalTierSpec = {
        **tier.to_json(),
        "durable_steps": r.train.save_steps,  # copies to the run directory: train.save_steps' cadence
        "nodes": [h for h, _ in plan.hosts],
        "ssh_config": r.cluster.ssh_config,
    }
    return out
