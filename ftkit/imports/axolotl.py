"""Axolotl YAML -> claims. Axolotl builds TrainingArguments from its own key names (micro_batch_size,
num_epochs, lr_scheduler, ...); its DeepSpeed file (``deepspeed:``) is read as a source too. What shapes the data
(datasets and their prompt formats, sample packing, held-out splits, special tokens) cannot be carried: ftkit reads
local jsonl/json/csv/parquet/txt with text, prompt+completion or messages fields (data.train)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ftkit.imports import fsdp as fsdp_source
from ftkit.imports import trainer_args as ta
from ftkit.imports.mapping import ACCUM, BF16, FP16, MICRO, TA_OPTIM, Sink, fmt
from ftkit.imports.read import Command
from ftkit.imports.values import to_bool, to_int, to_str, unset
from ftkit.recipe.schema import Value

if TYPE_CHECKING:  # pragma: no cover
    from ftkit.imports.build import Context

NONE = "no effect on training"
DATA = "convert it to a local jsonl (text, prompt+completion or messages fields) and set data.train"


def _model(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if (s := to_str(sink, key, value)) is not None:
        sink.map(key, "model.path", ctx.path_value(s, hub=True), origin="ta")


def _adapter(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    name = "" if unset(value) else str(value).lower()
    if name == "":
        sink.map(key, "peft", None, "no adapter: full fine-tuning", origin="ta")
    elif name == "lora":
        sink.map(key, "peft.method", "lora", origin="ta")
    elif name == "qlora":
        c = sink.refuse(key, "QLoRA: LoRA on a 4-bit quantized base model", "accepted: LoRA on the 16-bit base")
        c.target, c.value = "peft.method", "lora"
    else:
        sink.refuse(key, f"adapter {value}: ftkit trains LoRA or all parameters", "accepted: full fine-tuning")


def _targets(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value):
        sink.same(key, "unset")
    elif isinstance(value, list) and all(isinstance(x, str) for x in value):
        sink.map(key, "peft.target_modules", list(value), origin="ta")
    elif isinstance(value, str):
        sink.map(key, "peft.target_modules", [value], origin="ta")
    else:
        sink.problem(key, "expected a list of module names")


def _linear(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    b = to_bool(sink, key, value) if not unset(value) else False
    if b:
        sink.map(key, "peft.target_modules", ["all-linear"], "every linear layer but the output layer", origin="ta")
    elif b is False:
        sink.same(key, "off")


def _precision(target: str) -> ta.Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if unset(value):
            sink.same(key, "unset")
        elif str(value).lower() == "auto":
            sink.map(key, target, True, "auto: Axolotl uses it when the GPU supports it (Ampere or newer)", origin="ta")
        elif (b := to_bool(sink, key, value)) is not None:
            sink.map(key, target, b, origin="ta")

    return h


def _unset_or(handler: ta.Handler) -> ta.Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if unset(value):
            sink.same(key, "unset")
        else:
            handler(sink, key, value, args, ctx)

    return h


def _refuse_if_set(why: str, effect: str) -> ta.Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if unset(value) or value is False or str(value).lower() in ("false", "0", "none"):
            sink.same(key, "unset")
        else:
            sink.refuse(key, why, effect)

    return h


def _fsdp(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    """Axolotl's FSDP: ``fsdp_config`` (keys with or without ``fsdp_``), ``fsdp_version``, and in older configs an
    ``fsdp`` list of options (full_shard, auto_wrap, offload). Axolotl sets Accelerate's FSDP_* environment from
    them, so a key left out takes the plugin's own default."""
    config = args.get("fsdp_config")
    block = config if isinstance(config, dict) else {}
    asked = args.get("fsdp_version", block.get("fsdp_version", block.get("version", 1)))
    version = 2 if str(asked).strip() == "2" else 1
    on = bool(block) or not unset(args.get("fsdp"))
    if key == "fsdp_version":
        if on:
            sink.same(key, f"FSDP{version}" + (": imported as FSDP2" if version == 1 else ""))
        else:
            sink.no_effect(key, "no fsdp_config: FSDP is off", NONE)
    elif key == "fsdp":
        if unset(value) or value is False:
            sink.same(key, "FSDP off")
        else:
            fsdp_source.options(sink, key, value, version)
    elif unset(value):
        sink.same(key, "FSDP off")
    elif isinstance(value, dict):
        if unset(args.get("fsdp")):
            fsdp_source.backend(sink, key, version)
        fsdp_source.read(sink, key, value, version, fsdp_source.ENVIRONMENT)
    else:
        sink.problem(key, "expected a mapping of FSDP settings")


# Axolotl dataset types whose rows ftkit reads as they are: completion (a text field) and chat_template (messages)
_PLAIN_TYPES = {"completion": ("field", "text"), "chat_template": ("field_messages", "messages")}


def _datasets(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    """One local file of type completion (a text field) or chat_template (messages) is ftkit's data.train as it
    is; anything else (hub datasets, prompt formats such as alpaca, several datasets) cannot be carried."""
    if unset(value):
        sink.same(key, "unset")
        return
    entries = value if isinstance(value, list) else [value]
    first = entries[0] if len(entries) == 1 and isinstance(entries[0], dict) else {}
    kind = str(first.get("type", ""))
    path = str(first.get("path", ""))
    plain = _PLAIN_TYPES.get(kind)
    local = ctx.resolve_path(path, ctx.current_dir) if path else None
    suffix = path.rsplit(".", 1)[-1].lower()
    if plain and local is not None and local.is_file() and suffix in ("jsonl", "json", "csv", "parquet", "txt"):
        field, default = plain
        if str(first.get(field, default)) != default:
            sink.refuse(key, f"{kind} data with its {field} {first.get(field)}", f"rename it to {default}; {DATA}")
        else:
            sink.map(key, "data.train", ctx.path_value(str(local)), f"type {kind}: ftkit reads its {default} field")
    else:
        what = "several datasets" if len(entries) > 1 else f"dataset {path or '?'} of type {kind or '?'}"
        sink.refuse(key, f"Axolotl {what}", DATA)


def _sequence_len(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if (n := to_int(sink, key, value, minimum=1)) is not None:
        sink.map(
            key,
            "data.max_seq_len",
            n,
            "Axolotl drops longer examples; ftkit stops naming the row (data.truncate: false) or cuts them",
            origin="ta",
        )


def _wandb(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value):
        sink.same(key, "unset")
    elif key == "wandb_project":
        sink.map(key, "train.report_to", ["wandb"], "set WANDB_PROJECT for the run", origin="ta")
    else:
        sink.no_effect(key, "W&B run details: set WANDB_* in the environment", NONE)


def _save_eval_per_epoch(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value):
        sink.same(key, "unset")
    else:
        sink.no_effect(
            key, "a cadence per epoch: ftkit saves every train.save_steps, evaluates every train.eval_steps", NONE
        )


def _train_on_inputs(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value) or to_bool(sink, key, value) is False:
        sink.same(key, "loss on completions only: what ftkit's prompt+completion and messages formats do")
    else:
        sink.refuse(key, "loss on the prompts too", "loss on completions only")


_RL = "preference and reward objectives"


def _rl(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value) or value is False:
        sink.same(key, "unset: supervised fine-tuning")
    else:
        sink.hard(
            key,
            f"rl {fmt(value)}: a preference objective (DPO, IPO, KTO, ORPO, SimPO, GRPO) on paired or rated data; "
            "ftkit trains supervised fine-tuning only",
        )


def _reward(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value) or to_bool(sink, key, value) is False:
        sink.same(key, "off")
    else:
        sink.hard(key, "a reward model (a classification head trained on preferences): ftkit trains causal-LM SFT only")


def _rl_parameter(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(args.get("rl")):
        sink.no_effect(key, "a parameter of Axolotl's preference objectives, used only with rl (unset)", NONE)
    else:
        sink.no_effect(key, "a parameter of the preference objective rl, which is refused", NONE)


def _parallel(what: str) -> ta.Handler:
    """Tensor, context (sequence) or 2D data parallelism: a size of 1 (or unset) is plain data parallelism."""

    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if unset(value) or (not isinstance(value, bool) and str(value).strip() in ("1", "-1", "auto")):
            sink.same(key, "1: plain data parallelism, what ftkit runs")
        else:
            sink.hard(key, f"{what} (size {fmt(value)}): ftkit trains data-parallel only (ZeRO or FSDP2)")

    return h


def _warmup_steps(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value):
        return  # Axolotl's default warm-up, claimed by defaults()
    if (n := to_int(sink, key, value, minimum=0)) is not None:
        how = "Axolotl turns a 1-step warm-up into 2 (its trainer builder)" if n == 1 else ""
        sink.map(key, "train.warmup_steps", 2 if n == 1 else n, how, origin="ta")


def _batch_size(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    """Axolotl's batch_size is per GPU: micro_batch_size x gradient_accumulation_steps."""
    if unset(value) or (n := to_int(sink, key, value, minimum=1)) is None:
        return
    micro = args.get("micro_batch_size") or 1
    if not unset(args.get("gradient_accumulation_steps")):
        sink.no_effect(key, "gradient_accumulation_steps is set: Axolotl derives batch_size from it", NONE)
    elif isinstance(micro, int) and not isinstance(micro, bool) and micro > 0 and n % micro == 0:
        sink.map(key, ACCUM, n // micro, f"batch_size {n} / micro_batch_size {micro}", origin="ta")
    else:
        sink.problem(key, f"{n} is not a multiple of micro_batch_size {fmt(micro)}")


KEYS: dict[str, ta.Handler] = {
    "base_model": _model,
    "base_model_config": ta._none("the model's config: read from model.path", NONE),
    "model_type": ta._none("model class: ftkit loads AutoModelForCausalLM", NONE),
    "model_config_type": ta._none("model class", NONE),
    "tokenizer_type": ta._none("tokenizer class: ftkit loads AutoTokenizer", NONE),
    "tokenizer_config": _unset_or(
        lambda sink, key, value, args, ctx: sink.map(
            key, "model.tokenizer", ctx.path_value(str(value), hub=True), origin="ta"
        )
    ),
    "trust_remote_code": ta._none("remote code loading", NONE),
    "strict": ta._none("Axolotl's config strictness", NONE),
    "load_in_8bit": _refuse_if_set("an 8-bit quantized base model", "accepted: a 16-bit base"),
    "load_in_4bit": _refuse_if_set("a 4-bit quantized base model", "accepted: a 16-bit base"),
    "datasets": _datasets,
    "test_datasets": _refuse_if_set("Axolotl evaluation datasets", "set data.eval to a local file"),
    "chat_template": _refuse_if_set("a chat template for the data", "the tokenizer's own chat template"),
    "dataset_prepared_path": ta._none("Axolotl's tokenized-data cache", NONE),
    "val_set_size": lambda sink, key, value, args, ctx: (
        sink.same(key, "no held-out split")
        if unset(value) or str(value) in ("0", "0.0")
        else sink.refuse(key, f"holds out {value} of the training data for evaluation", "accepted: all of it trains")
    ),
    "output_dir": ta._output_dir,
    "adapter": _adapter,
    "lora_model_dir": _refuse_if_set("starts from saved adapters", "new adapters"),
    "sequence_len": _sequence_len,
    "sample_packing": _refuse_if_set("sample packing (several examples per sequence)", "one example per sequence"),
    "eval_sample_packing": ta._none("evaluation packing", NONE),
    "pad_to_sequence_len": ta._none("padding to sequence_len", "same loss; more memory"),
    "lora_r": _unset_or(ta._int("peft.r", 1)),
    "lora_alpha": _unset_or(ta._float("peft.alpha")),
    "lora_dropout": _unset_or(ta._float("peft.dropout")),
    "lora_target_modules": _targets,
    "lora_target_linear": _linear,
    "lora_fan_in_fan_out": _refuse_if_set("fan-in/fan-out LoRA layout", "PEFT's default layout"),
    "lora_modules_to_save": _refuse_if_set("extra fully trained modules", "only the LoRA adapters train"),
    "peft_use_dora": _refuse_if_set("DoRA", "plain LoRA"),
    "peft_use_rslora": _refuse_if_set("rank-stabilised LoRA scaling", "alpha / r scaling"),
    "gradient_accumulation_steps": _unset_or(ta._int(ACCUM, 1)),
    "micro_batch_size": _unset_or(ta._int(MICRO, 1)),
    "num_epochs": _unset_or(ta._float("train.epochs")),
    "max_steps": _unset_or(ta._max_steps),
    "optimizer": _unset_or(lambda sink, key, value, args, ctx: sink.map(key, TA_OPTIM, str(value), origin="ta")),
    "lr_scheduler": _unset_or(ta._scheduler),
    "learning_rate": _unset_or(ta._float("train.learning_rate")),
    "weight_decay": _unset_or(ta._float("train.weight_decay")),
    "adam_beta1": _unset_or(ta._float("train.adam_beta1")),
    "adam_beta2": _unset_or(ta._float("train.adam_beta2")),
    "adam_epsilon": _unset_or(ta._float("train.adam_epsilon")),
    "max_grad_norm": _unset_or(ta._float("train.max_grad_norm")),
    "warmup_steps": _warmup_steps,
    "warmup_ratio": _unset_or(ta._warmup),
    "batch_size": _batch_size,
    "rl": _rl,
    "reward_model": _reward,
    "process_reward_model": _reward,
    "tensor_parallel_size": _parallel("tensor parallelism"),
    "context_parallel_size": _parallel("context (sequence) parallelism"),
    "sequence_parallel_degree": _parallel("sequence parallelism"),
    "dp_replicate_size": _parallel("replicated data-parallel groups (HSDP)"),
    "dp_shard_size": _parallel("a sharding group smaller than the world (HSDP)"),
    "heads_k_stride": ta._none("a ring-attention detail of context parallelism", NONE),
    "ring_attn_func": ta._none("a ring-attention detail of context parallelism", NONE),
    "train_on_inputs": _train_on_inputs,
    "group_by_length": _refuse_if_set("batches grouped by length", "random batches"),
    "bf16": _precision(BF16),
    "fp16": _precision(FP16),
    "tf32": ta._none("TF32 matmuls: ftkit leaves PyTorch's default", ta.ROUNDING),
    "gradient_checkpointing": _unset_or(ta._gc),
    "gradient_checkpointing_kwargs": ta._none("checkpointing variant (use_reentrant)", ta.ROUNDING),
    "early_stopping_patience": _refuse_if_set("early stopping", "trains for the full length"),
    "resume_from_checkpoint": ta._none("ftkit resumes from the newest committed checkpoint", NONE),
    "auto_resume_from_checkpoints": ta._none("ftkit resumes from the newest committed checkpoint", NONE),
    "local_rank": ta._none("set by the launcher", NONE),
    "logging_steps": _unset_or(ta._cadence("train.logging_steps")),
    "save_steps": _unset_or(ta._cadence("train.save_steps")),
    "eval_steps": ta._eval_steps,
    "save_total_limit": _unset_or(ta._save_total_limit),
    "evals_per_epoch": _save_eval_per_epoch,
    "saves_per_epoch": _save_eval_per_epoch,
    "eval_table_size": ta._none("evaluation table logging", NONE),
    "xformers_attention": ta._none("attention kernel", ta.ROUNDING),
    "flash_attention": ta._none("attention kernel (flash-attn): ftkit uses the model's default", ta.ROUNDING),
    "sdp_attention": ta._none("attention kernel", ta.ROUNDING),
    "flex_attention": ta._none("attention kernel", ta.ROUNDING),
    "loss_watchdog_threshold": ta._none("stops on a loss spike (monitoring)", NONE),
    "loss_watchdog_patience": ta._none("stops on a loss spike (monitoring)", NONE),
    "debug": ta._none("debug output", NONE),
    "deepspeed": ta._deepspeed,
    "fsdp": _fsdp,
    "fsdp_config": _fsdp,
    "fsdp_version": _fsdp,
    "special_tokens": _refuse_if_set("special tokens added to the tokenizer", "the tokenizer as saved with the model"),
    "tokens": _refuse_if_set("tokens added to the tokenizer", "the tokenizer as saved with the model"),
    "seed": _unset_or(ta._int("train.seed")),
    "wandb_project": _wandb,
    "wandb_entity": _wandb,
    "wandb_watch": _wandb,
    "wandb_name": _wandb,
    "wandb_log_model": _wandb,
    "wandb_run_id": _wandb,
    "hub_model_id": ta._none("hub upload", NONE),
    "dataloader_num_workers": ta._none("data loading", NONE),
    "dataloader_pin_memory": ta._none("data loading", NONE),
    "dataloader_prefetch_factor": ta._none("data loading", NONE),
    "use_wandb": _wandb,
}
for _name in (
    "rl_beta trl dpo_use_weighting dpo_use_logits_to_keep dpo_label_smoothing dpo_norm_loss dpo_padding_free "
    "orpo_alpha rpo_alpha simpo_gamma cpo_alpha kto_desirable_weight kto_undesirable_weight max_prompt_len"
).split():
    KEYS[_name] = _rl_parameter

# Axolotl's defaults for the keys that shape training (axolotl/utils/schemas/training.py HyperparametersConfig and
# config.py AxolotlInputConfig): a key the file leaves out is filled with these before TrainingArguments are built.
DEFAULTS: tuple[tuple[str, str, Value], ...] = (
    ("micro_batch_size", MICRO, 1),
    ("gradient_accumulation_steps", ACCUM, 1),
    ("lr_scheduler", "train.lr_scheduler", "cosine"),
    ("optimizer", TA_OPTIM, "adamw_torch_fused"),
    ("weight_decay", "train.weight_decay", 0.0),
    ("sequence_len", "data.max_seq_len", 512),
)


def defaults(sink: Sink, args: Mapping[str, object]) -> None:
    """Claims for what Axolotl fills in itself: its schema's defaults, bf16 "auto", one epoch, and its warm-up of
    3% of the run's steps (at most 100; axolotl/core/builders/base.py ``_configure_warmup_and_logging``)."""

    def absent(name: str) -> bool:
        return unset(args.get(name))

    def label(name: str) -> str:
        return f"{name} (absent)" if name not in args else name

    how = "Axolotl's default"
    for name, target, value in DEFAULTS:
        if name == "gradient_accumulation_steps" and not absent("batch_size"):
            continue
        if absent(name):
            sink.tool_default(label(name), target, value, f"{how} {fmt(value)}", absent=False)
    if absent("learning_rate"):
        sink.problem("learning_rate", "Axolotl requires learning_rate (its schema has no default)")
    steps = args.get("max_steps")
    by_steps = isinstance(steps, int) and not isinstance(steps, bool) and steps > 0
    if absent("num_epochs") and not by_steps:
        sink.tool_default(label("num_epochs"), "train.epochs", 1.0, f"{how} 1 epoch", absent=False)
    if absent("bf16") and absent("fp16") and absent("bfloat16"):
        sink.tool_default(label("bf16"), BF16, True, f'{how} "auto": bf16 on GPUs that support it', absent=False)
    if absent("warmup_steps") and absent("warmup_ratio"):
        rule = "3% of the run's optimizer steps, at most 100, and 2 instead of 1"
        if by_steps:
            n = min(int(0.03 * steps), 100)  # type: ignore[operator]  # by_steps: an int
            n = 2 if n == 1 else n
            sink.tool_default(label("warmup_steps"), "train.warmup_steps", n, f"{how} warm-up: {rule}", absent=False)
        else:
            c = sink.refuse(
                "warmup_steps",
                f"{how} warm-up is {rule}, counted from the data: ftkit cannot count them for a run measured in "
                "epochs; set train.warmup_steps",
                "accepted: no warm-up",
            )
            c.target, c.value, c.origin = "train.warmup_steps", 0, "ta"


def read(sink: Sink, data: Mapping[str, object] | Command, ctx: Context) -> None:

    if isinstance(data, Command):  # `axolotl train config.yml`, `accelerate launch -m axolotl.cli.train config.yml`
        for path in data.positional:
            ctx.follow(sink, f"{data.launcher} {data.script or 'train'} {path}", path, "axolotl")
        if data.launcher != "axolotl":
            ta._launcher(sink, data, ctx)
        return
    ta.read(sink, data, ctx, extra=KEYS, kind="Axolotl")
    defaults(sink, data)
