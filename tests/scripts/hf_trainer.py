"""A plain HF Trainer script with HfArgumentParser (it never imports ftkit).

``python hf_trainer.py --model M --data FILE [--fail_at_step N] [TrainingArguments]``; ``--fail_at_step``
raises an exception after that optimizer step, every time (a bug in the script, for the tests); ``--save_nothing``
uses a Trainer whose checkpoint save writes nothing.
"""

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


@dataclass
class ScriptArguments:
    model: str = field(metadata={"help": "model directory"})
    data: str = field(metadata={"help": "jsonl file with a text field"})
    max_len: int = 128
    fail_at_step: int = 0
    save_nothing: bool = False  # a Trainer subclass whose checkpoint save writes nothing


class FailAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if self.step and state.global_step == self.step:
            raise RuntimeError(f"the script's own bug at step {state.global_step}")


class SavesNothing(Trainer):
    def _save_checkpoint(self, model, trial):
        pass


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(script.model)
    raw = load_dataset("json", data_files=script.data, split="train")
    data = raw.map(lambda b: tokenizer(b["text"], truncation=True, max_length=script.max_len), batched=True)
    data = data.remove_columns(["text"])
    trainer = (SavesNothing if script.save_nothing else Trainer)(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=[FailAt(script.fail_at_step)],
    )
    trainer.train(resume_from_checkpoint=True)  # HF's get_last_checkpoint: ftkit overrides it with its choice
    trainer.save_model()


if __name__ == "__main__":
    main()
