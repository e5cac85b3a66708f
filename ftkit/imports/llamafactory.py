"""LLaMA-Factory YAML (or ``llamafactory-cli train`` / ``src/train.py`` command line) -> claims: TrainingArguments
plus LLaMA-Factory's own keys (model_name_or_path, stage, finetuning_type, lora_*, cutoff_len, dataset, template).

LLaMA-Factory's defaults that differ from ftkit's are claimed explicitly: gradient checkpointing is on unless
``disable_gradient_checkpointing``; LoRA rank 8, alpha 2 x rank, dropout 0 and ``lora_target: all``; examples longer
than ``cutoff_len`` are cut (data.truncate: true). Datasets and prompt templates cannot be carried.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ftkit.imports import trainer_args as ta
from ftkit.imports.mapping import Sink
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


def _stage(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    stage = str(value).lower()
    if stage == "sft":
        sink.same(key, "supervised fine-tuning: what ftkit trains")
    elif stage == "pt":
        sink.same(key, "causal-LM pre-training on text: ftkit's text field")
    else:
        sink.hard(key, f"stage {value} (a preference/reward objective): ftkit trains supervised fine-tuning only")


def _finetuning_type(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    kind = str(value).lower()
    if kind == "lora":
        sink.map(key, "peft.method", "lora", origin="ta")
    elif kind == "full":
        sink.map(key, "peft", None, "all parameters train", origin="ta")
    else:
        sink.hard(key, f"finetuning_type {value}: ftkit trains LoRA or all parameters")


def _lora_target(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    names = [x.strip() for x in (value if isinstance(value, list) else str(value).split(",")) if str(x).strip()]
    if names == ["all"]:
        sink.map(key, "peft.target_modules", ["all-linear"], "every linear layer but the output layer", origin="ta")
    elif names:
        sink.map(key, "peft.target_modules", names, origin="ta")
    else:
        sink.problem(key, "expected module names or all")


def _cutoff(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if (n := to_int(sink, key, value, minimum=1)) is not None:
        sink.map(key, "data.max_seq_len", n, origin="ta")
        sink.map(key, "data.truncate", True, "LLaMA-Factory cuts longer examples", origin="ta")


def _no_gc(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if (b := to_bool(sink, key, value)) is not None:
        sink.map(key, "model.gradient_checkpointing", not b, origin="ta")


def _refuse_if_set(why: str, effect: str) -> ta.Handler:
    def h(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
        if unset(value) or value is False or str(value).lower() in ("false", "0", "none"):
            sink.same(key, "unset")
        else:
            sink.refuse(key, why, effect)

    return h


def _val_size(sink: Sink, key: str, value: object, args: Mapping[str, object], ctx: Context) -> None:
    if unset(value) or str(value) in ("0", "0.0"):
        sink.same(key, "no held-out split")
    else:
        sink.refuse(key, f"holds out {value} of the training data for evaluation", "accepted: all of it trains")


KEYS: dict[str, ta.Handler] = {
    "model_name_or_path": _model,
    "trust_remote_code": ta._none("remote code loading", NONE),
    "stage": _stage,
    "finetuning_type": _finetuning_type,
    "lora_target": _lora_target,
    "lora_rank": ta._int("peft.r", 1),
    "lora_alpha": ta._float("peft.alpha"),
    "lora_dropout": ta._float("peft.dropout"),
    "additional_target": _refuse_if_set("extra fully trained modules", "only the LoRA adapters train"),
    "use_rslora": _refuse_if_set("rank-stabilised LoRA scaling", "alpha / r scaling"),
    "use_dora": _refuse_if_set("DoRA", "plain LoRA"),
    "pissa_init": _refuse_if_set("PiSSA initialisation", "PEFT's default initialisation"),
    "loraplus_lr_ratio": _refuse_if_set("LoRA+ learning rates", "one learning rate"),
    "adapter_name_or_path": _refuse_if_set("starts from saved adapters", "new adapters"),
    "create_new_adapter": ta._none("adapter bookkeeping", NONE),
    "quantization_bit": _refuse_if_set("a quantized base model (QLoRA)", "accepted: a 16-bit base"),
    "quantization_method": ta._none("quantization backend", NONE),
    "double_quantization": ta._none("quantization detail", NONE),
    "dataset": _refuse_if_set("LLaMA-Factory datasets (names in dataset_info.json)", DATA),
    "eval_dataset": _refuse_if_set("LLaMA-Factory evaluation datasets", "set data.eval to a local file"),
    "template": _refuse_if_set("LLaMA-Factory's prompt template", "the tokenizer's chat template (messages data)"),
    "dataset_dir": ta._none("where LLaMA-Factory looks up datasets", NONE),
    "max_samples": _refuse_if_set("uses only the first examples", "accepted: every example trains"),
    "val_size": _val_size,
    "packing": _refuse_if_set("sequence packing", "one example per sequence"),
    "neat_packing": _refuse_if_set("sequence packing", "one example per sequence"),
    "train_on_prompt": _refuse_if_set("loss on the prompts too", "loss on completions only"),
    "mask_history": _refuse_if_set("loss on the last turn only", "loss on every assistant turn"),
    "streaming": ta._none("streamed data loading", NONE),
    "mix_strategy": _refuse_if_set("dataset mixing", DATA),
    "interleave_probs": _refuse_if_set("dataset mixing", DATA),
    "tokenized_path": ta._none("LLaMA-Factory's tokenized-data cache", NONE),
    "cutoff_len": _cutoff,
    "overwrite_cache": ta._none("LLaMA-Factory's data cache", NONE),
    "preprocessing_num_workers": ta._none("data preprocessing workers", NONE),
    "plot_loss": ta._none("a loss plot (ftkit status --plot draws one)", NONE),
    "flash_attn": ta._none("attention kernel: ftkit uses the model's default", ta.ROUNDING),
    "enable_liger_kernel": ta._none("Liger kernels", ta.ROUNDING),
    "use_unsloth": ta._none("Unsloth kernels", ta.ROUNDING),
    "disable_gradient_checkpointing": _no_gc,
    "upcast_layernorm": _refuse_if_set("fp32 layer norms", "layer norms in the training precision"),
    "rope_scaling": _refuse_if_set("RoPE scaling", "the model's own positions"),
    "shift_attn": _refuse_if_set("shift short attention", "full attention"),
    "freeze_vision_tower": ta._none("multimodal detail", NONE),
    "image_max_pixels": ta._none("multimodal detail", NONE),
    "video_max_pixels": ta._none("multimodal detail", NONE),
    "include_effective_tokens_per_second": ta._none("logging", NONE),
}


def read(sink: Sink, data: Mapping[str, object] | Command, ctx: Context) -> None:

    if isinstance(data, Command) and data.launcher == "llamafactory-cli":
        for path in data.positional:
            ctx.follow(sink, f"llamafactory-cli train {path}", path, "llamafactory")
        ta._launcher(sink, data, ctx)
        if data.args:  # key=value overrides after the config
            ta.read(sink, dict(data.args), ctx, extra=KEYS, kind="LLaMA-Factory")
        return
    ta.read(sink, data, ctx, extra=KEYS, kind="LLaMA-Factory")
    args = data.args if isinstance(data, Command) else data
    if "disable_gradient_checkpointing" not in args:
        sink.implied("disable_gradient_checkpointing", "model.gradient_checkpointing", True, "LLaMA-Factory's default")
    if str(args.get("finetuning_type", "lora")).lower() == "lora":
        if "finetuning_type" not in args:
            sink.implied("finetuning_type", "peft.method", "lora", "LLaMA-Factory's default: LoRA")
        rank = args.get("lora_rank", 8)
        defaults: tuple[tuple[str, str, Value], ...] = (
            ("lora_rank", "peft.r", 8),
            (
                "lora_alpha",
                "peft.alpha",
                float(rank) * 2 if isinstance(rank, (int, str)) and str(rank).isdigit() else 16.0,
            ),
            ("lora_dropout", "peft.dropout", 0.0),
            ("lora_target", "peft.target_modules", ["all-linear"]),
        )
        for key, target, default in defaults:
            if key not in args:
                sink.implied(key, target, default, "LLaMA-Factory's default")
