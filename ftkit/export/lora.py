"""LoRA: the adapter as PEFT saves it, or merged into the base model, streamed like everything else.

The trained adapter comes from the checkpoint (DeepSpeed's fp32 master copies of the ``lora_A``/``lora_B``
parameters, or the adapter file of ``final/``); adapters are small, so they are held in memory whole. The base
model is the recipe's ``model.path`` (as recorded in the checkpoint's fingerprint), read one tensor at a time.

Merging does what PEFT's ``merge_and_unload`` does for a linear layer, in the same order of operations so the
result is the same to the bit in fp32: ``W += transpose(B @ A, fan_in_fan_out) * scaling`` with ``scaling =
lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), in float32, then cast to the export dtype. What ftkit does not train
is refused with one line rather than merged wrongly: DoRA, LoRA biases, ``modules_to_save``, per-module rank or
alpha patterns, embedding adapters, adapters on parameters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftkit.export.source import ExportRefused
from ftkit.export.weights import Entry
from ftkit.rundir.records import JSON, JSONObject

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
# DeepSpeed/the live module: ...q_proj.lora_A.default.weight; PEFT's saved file: ...q_proj.lora_A.weight
_LIVE = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B)\.(?P<adapter>[A-Za-z0-9_-]+)\.weight$")
_SAVED = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B)\.weight$")


@dataclass(frozen=True)
class LoraMath:
    scaling: float
    fan_in_fan_out: bool


def lora_math(cfg: JSONObject) -> LoraMath:
    """The merge's constants from ``adapter_config.json``; refuses what a plain LoRA merge would get wrong."""
    unsupported: dict[str, JSON] = {
        "use_dora": cfg.get("use_dora"),
        "lora_bias": cfg.get("lora_bias"),
        "modules_to_save": cfg.get("modules_to_save"),
        "rank_pattern": cfg.get("rank_pattern"),
        "alpha_pattern": cfg.get("alpha_pattern"),
        "target_parameters": cfg.get("target_parameters"),
        "trainable_token_indices": cfg.get("trainable_token_indices"),
    }
    if cfg.get("bias", "none") != "none":
        unsupported["bias"] = cfg["bias"]
    if cfg.get("peft_type", "LORA") != "LORA":
        unsupported["peft_type"] = cfg["peft_type"]
    bad = [f"{k}={v!r}" for k, v in unsupported.items() if v]
    if bad:
        raise ExportRefused(f"adapter_config.json: {bad[0]}: export merges plain LoRA only (use --adapter)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise ExportRefused(f"adapter_config.json: r={r!r}, lora_alpha={alpha!r} are not a LoRA rank and alpha")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return LoraMath(float(scaling), bool(cfg.get("fan_in_fan_out")))


def adapter_entries(entries: list[Entry], *, live_names: bool, held_as: torch.dtype | None = None) -> list[Entry]:
    """The adapter's tensors under the names PEFT's ``save_pretrained`` writes (``...lora_A.weight``).

    ``live_names``: the entries carry the module's own names (DeepSpeed checkpoints: ``...lora_A.default.weight``);
    otherwise they come from a saved adapter file already. Anything that is not a LoRA A/B matrix of the
    ``default`` adapter (what HF Trainer trains) is refused. ``held_as``: the training precision (a torch dtype)
    when it is not fp32: DeepSpeed's fp32 master copies are rounded to it, which is what the module held, computed
    with and saved as the adapter (so a bf16 run's merge equals PEFT's merge of that adapter, bit for bit).
    """
    out = []
    for e in entries:
        if live_names:
            m = _LIVE.match(e.name)
            if m is None or m.group("adapter") != "default":
                raise ExportRefused(
                    f"{e.name}: a trained parameter that is not a LoRA A/B matrix of the default adapter"
                )
            name = f"{m.group('module')}.{m.group('which')}.weight"
        else:
            if _SAVED.match(e.name) is None:
                raise ExportRefused(f"{e.name}: not a LoRA A/B matrix (export handles plain LoRA adapters)")
            name = e.name
        out.append(Entry(name, e.shape, e.dtype, _held(e.read, held_as) if held_as is not None else e.read))
    return out


def _held(read: Callable[[], torch.Tensor], dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    def rounded() -> torch.Tensor:
        t = read()
        return t.to(dtype).to(t.dtype)

    return rounded


def merge_transform(
    adapter: list[Entry], base_names: set[str], math_: LoraMath
) -> tuple[Callable[[Entry, torch.Tensor], torch.Tensor], int]:
    """A transform for :func:`ftkit.export.weights.write_safetensors` that adds each adapter's delta to its base
    weight, and how many base weights it changes. Refuses an adapter whose base weight is not in the base model."""
    import torch

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for e in adapter:
        m = _SAVED.match(e.name)
        assert m is not None  # adapter_entries checked the names
        module = m.group("module").removeprefix(PEFT_PREFIX)
        pairs.setdefault(f"{module}.weight", {})[m.group("which")] = e.read().float()
    for name, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ExportRefused(f"{name}: the adapter has only {sorted(ab)[0]}")
        if name not in base_names:
            raise ExportRefused(f"{name}: adapted by LoRA but not in the base model's weights")

    def transform(e: Entry, t: torch.Tensor) -> torch.Tensor:
        ab = pairs.get(e.name)
        if ab is None:
            return t
        w = t.to(torch.float32)  # the reader's own copy: adding in place is safe
        delta = ab["lora_B"] @ ab["lora_A"]
        if math_.fan_in_fan_out:
            delta = delta.T
        w += delta * math_.scaling
        return w

    return transform, len(pairs)
