"""ftkit: one fine-tuning recipe in, DeepSpeed/Accelerate configs, a launched HF Trainer job and recovery out.

The controller (everything under ``ftkit/``) stays import-light: no torch, deepspeed, transformers, accelerate
or peft at import time. Only the per-rank training entry (``ftkit.launch``) imports the heavy stack.
"""

__version__ = "0.1.0"
