"""An unmodified TRL SFT script (it never imports ftkit): ``python trl_sft.py --model M --data FILE [SFTConfig]``."""

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import SFTConfig, SFTTrainer


@dataclass
class Paths:
    model: str = field(metadata={"help": "model directory"})
    data: str = field(metadata={"help": "jsonl file with a text field"})


def main() -> None:
    paths, config = HfArgumentParser((Paths, SFTConfig)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(paths.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(paths.model)
    dataset = load_dataset("json", data_files=paths.data, split="train")
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model(config.output_dir)


if __name__ == "__main__":
    main()
