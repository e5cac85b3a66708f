"""FSDP sources, in one place: refused until ftkit has an FSDP backend.

Accelerate's ``distributed_type: FSDP`` with its ``fsdp_config``, TrainingArguments' ``fsdp``/``fsdp_config`` and
Axolotl's ``fsdp``/``fsdp_config``/``fsdp_version`` all come here. When ftkit gains FSDP2 (docs/design.md,
FSDP2 (not yet): ``fsdp_version: 2``, auto-wrap by layer class, ``reshard_after_forward``, ``offload_params``, sharded
state dict), this module maps them to the recipe instead (FSDP1 sources as FSDP2, with a report line), and nothing
else changes.
"""

from __future__ import annotations

from ftkit.imports.mapping import Sink

WHY = "FSDP (version {v}) is not supported: ftkit supports DeepSpeed only so far"


def fsdp_version(value: object) -> int:
    """The FSDP version a config asks for: ``fsdp_version: 2`` (Accelerate, Axolotl), else 1."""
    if isinstance(value, dict):
        v = value.get("fsdp_version", value.get("version", 1))
        return 2 if str(v).strip() == "2" else 1
    return 1


def refuse_fsdp(sink: Sink, key: str, value: object, version: int | None = None) -> None:
    """One line for an FSDP setting: refused (hard) until the FSDP mapping exists."""
    sink.hard(key, WHY.format(v=version or fsdp_version(value)))
