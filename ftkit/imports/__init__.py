"""``ftkit import`` and ``ftkit check --against``: a team's existing DeepSpeed, Accelerate, TrainingArguments,
Axolotl and LLaMA-Factory configs in, one recipe out (every source key reported), and the semantic diff between a
hand-written config and what a recipe renders.

One module per source format (:mod:`.deepspeed`, :mod:`.accelerate`, :mod:`.trainer_args`, :mod:`.axolotl`,
:mod:`.llamafactory`; their FSDP settings in :mod:`.fsdp`), the report and how sources combine in :mod:`.mapping`, the
whole import in :mod:`.build`, ``--plan`` in :mod:`.adopt`, the diff in :mod:`.against`. Import-light: no torch,
transformers, deepspeed, accelerate or peft.
"""

from ftkit.imports.against import Difference, check_against, diff_against
from ftkit.imports.build import ImportResult, import_configs
from ftkit.imports.read import KINDS

__all__ = ["KINDS", "Difference", "ImportResult", "check_against", "diff_against", "import_configs"]
