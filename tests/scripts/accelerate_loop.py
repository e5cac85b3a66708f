"""A training loop of its own (accelerate.Accelerator, no HF Trainer) that uses ftkit.hf's loop API.

``python accelerate_loop.py MODEL_DIR DATA.jsonl``: the recipe's batch size, learning rate, seed, max steps and save
cadence (``ftkit.hf.spec().training_args``); resumes from the checkpoint ftkit chose; reports every step, saves
through ``ftkit.hf.checkpoint`` and ends with ``ftkit.hf.final``.
"""

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer

import ftkit.hf

model_dir, data_file = sys.argv[1], sys.argv[2]
args = ftkit.hf.spec().training_args
set_seed(args["seed"])
accelerator = Accelerator()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
texts = [json.loads(line)["text"] for line in open(data_file)]
model = AutoModelForCausalLM.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=args["learning_rate"])
model, optimizer = accelerator.prepare(model, optimizer)

micro, world, rank = args["per_device_train_batch_size"], accelerator.num_processes, accelerator.process_index
start = 0
if ftkit.hf.resume_checkpoint():
    accelerator.load_state(ftkit.hf.resume_checkpoint())
    start = ftkit.hf.resume_step()

for step in range(start + 1, args["max_steps"] + 1):
    first = ((step - 1) * micro * world + rank * micro) % len(texts)
    batch = [texts[(first + i) % len(texts)] for i in range(micro)]
    enc = tokenizer(batch, return_tensors="pt", padding="max_length", truncation=True, max_length=32)
    loss = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=enc["input_ids"]).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    mean = accelerator.reduce(loss.detach(), "mean").item()
    stop = ftkit.hf.step(step, mean)
    if step % args["save_steps"] == 0 or stop:
        with ftkit.hf.checkpoint(step) as path:
            accelerator.save_state(str(path))
    if stop:
        sys.exit(0)

with ftkit.hf.final(args["max_steps"]) as path:
    accelerator.unwrap_model(model).save_pretrained(str(path), is_main_process=accelerator.is_main_process)
