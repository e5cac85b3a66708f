"""Fine-tune a causal language model on a text file: written the way transformers' example scripts are (argument
dataclasses parsed with HfArgumentParser, ``load_dataset`` from local files, texts grouped into blocks, ``Trainer``,
``get_last_checkpoint``). It has never heard of ftkit.

    python run_clm.py --model_name_or_path M --train_file data.jsonl --output_dir out [TrainingArguments...]
"""

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import transformers
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or a model identifier."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's own."})
    torch_dtype: str | None = field(default=None, metadata={"choices": ["auto", "bfloat16", "float16", "float32"]})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "The input training data file (a jsonlines or text file)."})
    text_column_name: str = field(default="text", metadata={"help": "The column holding the text."})
    block_size: int = field(default=64, metadata={"help": "Length of the blocks the texts are grouped into."})
    preprocessing_num_workers: int | None = field(default=None)
    max_train_samples: int | None = field(default=None)


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.info(f"Training/evaluation parameters {training_args}")

    # Detecting the last checkpoint.
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)

    extension = data_args.train_file.split(".")[-1]
    extension = "json" if extension == "jsonl" else extension
    raw_datasets = load_dataset(extension, data_files={"train": data_args.train_file})

    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    dtype = model_args.torch_dtype
    if dtype not in ("auto", None):
        dtype = getattr(__import__("torch"), dtype)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config, dtype=dtype)

    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))

    column_names = list(raw_datasets["train"].features)
    text_column_name = data_args.text_column_name if data_args.text_column_name in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(
            tokenize_function,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=column_names,
            desc="Running tokenizer on dataset",
        )

    block_size = min(data_args.block_size, tokenizer.model_max_length)

    # Main data processing function that will concatenate all texts from our dataset and generate chunks of
    # block_size.
    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(
            group_texts,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            desc=f"Grouping texts in chunks of {block_size}",
        )

    train_dataset = lm_datasets["train"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )

    checkpoint = None
    if training_args.resume_from_checkpoint is not None:
        checkpoint = training_args.resume_from_checkpoint
    elif last_checkpoint is not None:
        checkpoint = last_checkpoint
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()  # Saves the tokenizer too for easy upload

    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    metrics["perplexity"] = math.exp(metrics["train_loss"]) if metrics.get("train_loss", 0) < 50 else float("inf")
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()


if __name__ == "__main__":
    main()
