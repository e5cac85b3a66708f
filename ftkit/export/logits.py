"""Proof by logits: the written model gives the checkpoint's logits, computed on a path that shares no code with
the export's readers and writer.

The export is loaded as a user would load it (``AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)``; an
adapter with ``PeftModel.from_pretrained(base, DIR)``). The reference is the checkpoint's own training state,
loaded the way its authors' tools load it:

============================  ==================================================================================
source                        independent path
============================  ==================================================================================
ZeRO-1/2/3 (with offload)     DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` (``zero_to_fp32``), loaded
                              with ``load_state_dict`` into a model built from the checkpoint's ``config.json``
ZeRO-0                        ``zero_to_fp32`` has no ZeRO-0: DeepSpeed's saved module state dict
                              (``mp_rank_00_model_states.pt``, ``torch.load`` whole), as DeepSpeed's own
                              ``load_checkpoint`` loads it
universal                     ``zero_to_fp32`` of the ZeRO shards it was converted from (the committed ones)
HF files (``final/``)         ``from_pretrained`` of the source directory, and the logits the run itself computed
                              with the live trained model at the end of training (``RUN/ftkit/probe.json``)
LoRA, merged                  PEFT: ``PeftModel.from_pretrained(base, CHECKPOINT).merge_and_unload()`` of the
                              adapter file HF Trainer wrote into the checkpoint
LoRA, adapter only            PEFT: ``PeftModel.from_pretrained(base, CHECKPOINT)`` (not merged)
============================  ==================================================================================

Tolerances. Both sides compute in float32 on CPU. An fp32 export must match within max |diff| <= 1e-5
(``FP32_ATOL``; measured here: 0, the same weights through the same kernels). A bf16 or fp16 export is compared
with the reference *rounded to the same dtype* (weights cast down and back up, which is exactly what loading the
export in float32 does), with the same 1e-5: that proves the file holds the trained weights, rounded once and
nothing else. How far rounding itself moves the logits (export vs the unrounded reference) is reported beside it,
not judged: it depends on the model, not on the export. Where the reference itself holds coarser weights than the
export (a bf16 run's ZeRO-0 module against an fp32 export of it), the export is rounded to the reference's dtype
for the judged comparison. The live model's logits (``probe.json``) are judged only for an fp32 run exported in
fp32: a bf16 forward pass differs from a float32 one by more than any tolerance that proves anything. The probe
batch is the run's own probe (the first tokens of the first training example, when ``RUN/ftkit/probe.json``
exists) plus two fixed pseudo-random sequences of 32
token ids (seed 1234), so a vocabulary row or position the data never reaches is covered too.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

from ftkit.export.source import RunFacts, Source
from ftkit.export.weights import cpu_only, torch_dtype

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

FP32_ATOL = 1e-5
PROBE_SEED = 1234
PROBE_SHAPE = (2, 32)
PROBE_FILE = "probe.json"


class Probe(TypedDict):
    """``RUN/ftkit/probe.json``: probe tokens and the logits the live trained model computed for them."""

    input_ids: list[list[int]]  # [batch, tokens]
    logits: list[list[list[float]]]  # [batch, tokens, vocabulary]


class CheckRecord(TypedDict):
    """A :class:`Check` as JSON (``ftkit_export.json``'s ``verdict.checks``)."""

    reference: str
    max_abs_diff: float
    tolerance: float | None
    tokens: int


class VerdictRecord(TypedDict, total=False):
    """A :class:`Verdict` as JSON (``ftkit_export.json``'s ``verdict``)."""

    dtype: str
    checks: list[CheckRecord]
    seconds: float
    peak_rss_bytes: int | None
    verified_utc: str
    ok: bool


@dataclass
class Check:
    """One comparison: export logits against one reference; ``tolerance`` None: reported, not judged."""

    reference: str
    max_abs_diff: float
    tolerance: float | None
    tokens: int

    @property
    def ok(self) -> bool:
        return self.tolerance is None or self.max_abs_diff <= self.tolerance

    def line(self) -> str:
        if self.tolerance is None:
            return f"max |logit diff| {self.max_abs_diff:.3g} against {self.reference} (reported, not judged)"
        verdict = "<=" if self.ok else ">"
        return f"max |logit diff| {self.max_abs_diff:.3g} {verdict} {self.tolerance:g} against {self.reference}"


@dataclass
class Verdict:
    """The logits proof of one export: every check, and whether all judged ones passed."""

    dtype: str
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_bytes: int | None = None
    verified_utc: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def summary(self) -> str:
        judged = [c for c in self.checks if c.tolerance is not None]
        worst = max(judged, key=lambda c: c.max_abs_diff) if judged else None
        word = "PASSED" if self.ok else "FAILED"
        if worst is None:
            return f"logits check {word}: nothing to compare"
        return f"logits check {word}: {worst.line()}"

    def to_json(self) -> VerdictRecord:
        d = asdict(self)
        d["ok"] = self.ok
        return cast(VerdictRecord, d)

    @classmethod
    def from_json(cls, d: VerdictRecord) -> Verdict:
        checks = [Check(**c) for c in d.get("checks") or []]
        return cls(
            d.get("dtype", "fp32"), checks, d.get("seconds", 0.0), d.get("peak_rss_bytes"), d.get("verified_utc", "")
        )


# ------------------------------------------------------------------------------------------------- plumbing


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DeepSpeed's converter prints progress and tqdm bars; transformers warns about what it loads. The CLI
    prints its own lines: swallow theirs (errors still raise)."""

    cpu_only()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    level = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        transformers.utils.logging.set_verbosity(level)


def probe_batches(vocab_size: int, max_positions: int | None, run_probe: Probe | None) -> list[torch.Tensor]:
    """The run's probe tokens first (when there are any), then the fixed random sequences."""
    import torch

    batches = []
    if run_probe is not None:
        batches.append(torch.tensor(run_probe["input_ids"], dtype=torch.long))
    length = min(PROBE_SHAPE[1], max_positions or PROBE_SHAPE[1])
    gen = torch.Generator().manual_seed(PROBE_SEED)
    batches.append(torch.randint(0, vocab_size, (PROBE_SHAPE[0], length), generator=gen))
    return batches


def _run_probe(run_dir: Path | None) -> Probe | None:
    return None if run_dir is None else _read_probe(run_dir / "ftkit" / PROBE_FILE)


def _read_probe(path: Path) -> Probe | None:
    try:
        data = json.loads(path.read_text())
        return (
            cast(Probe, data)
            if isinstance(data.get("input_ids"), list) and isinstance(data.get("logits"), list)
            else None
        )
    except (OSError, ValueError, AttributeError):
        return None


def logits_of(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    import torch

    model.eval()
    with torch.no_grad():
        return [model(input_ids=b, attention_mask=torch.ones_like(b)).logits.float() for b in batches]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def round_to(model: torch.nn.Module, dtype: torch.dtype, only_lora: bool = False) -> None:
    """Cast the model's floating-point weights down to ``dtype`` and back, in place (what loading a ``dtype``
    export in float32 does to them)."""
    import torch

    if dtype == torch.float32:
        return
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point() and (not only_lora or "lora_" in name):
                t.copy_(t.to(dtype).to(torch.float32))


def _base_model(facts: RunFacts) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    hub = {"revision": facts.model_revision} if facts.model_revision else {}
    return AutoModelForCausalLM.from_pretrained(facts.model_path, dtype=torch.float32, **hub)


def _model_from_state(config_dir: str, state: dict[str, torch.Tensor], what: str) -> PreTrainedModel:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise ValueError(f"{what} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if tied:
        model.tie_weights()
    return model


def _config_dir(source: Source, facts: RunFacts) -> str:
    return str(source.path) if (source.path / "config.json").is_file() else facts.model_path


# ------------------------------------------------------------------------------------------------- references


def reference_model(source: Source, facts: RunFacts, kind: str) -> tuple[torch.nn.Module, str, torch.dtype]:
    """The checkpoint's training state on the independent path (see the module docstring), its name, and the
    dtype its weights were held in there (a bf16 run's ZeRO-0 module is bf16; everything else fp32)."""
    import torch

    if source.is_lora:
        from peft import PeftModel

        if (
            not (source.path / "adapter_model.safetensors").is_file()
            and not (source.path / "adapter_model.bin").is_file()
        ):
            raise ValueError(f"{source.name}: no adapter file HF Trainer wrote, nothing independent to compare with")
        peft = PeftModel.from_pretrained(_base_model(facts), str(source.path))
        if kind == "adapter":
            return peft, f"PEFT's PeftModel.from_pretrained(base, {source.name})", torch.float32
        return peft.merge_and_unload(), f"PEFT's merge_and_unload() of {source.name}'s adapter", torch.float32
    if source.layout in ("zero", "universal") and source.stage != 0 and _has_zero_shards(source):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(source.path), tag=source.tag)
        what = f"DeepSpeed's zero_to_fp32 of {source.name}/{source.tag}"
        return _model_from_state(_config_dir(source, facts), state, what), what, torch.float32
    if source.layout == "zero":  # stage 0
        states = torch.load(str(source.path / str(source.tag) / "mp_rank_00_model_states.pt"), weights_only=False)
        module = states["module"]
        held = next((t.dtype for t in module.values() if t.is_floating_point()), torch.float32)
        what = f"DeepSpeed's saved module ({source.name}/{source.tag}/mp_rank_00_model_states.pt)"
        return _model_from_state(_config_dir(source, facts), module, what), what, held
    if source.layout == "universal":  # the original shards are gone: DeepSpeed's universal files, loaded whole
        zero = source.path / str(source.universal_tag) / "zero"
        state = {p.name: torch.load(str(p / "fp32.pt"), weights_only=False)["param"] for p in zero.iterdir()}
        what = f"DeepSpeed's universal files ({source.name}/{source.universal_tag}), loaded whole"
        return _model_from_state(_config_dir(source, facts), state, what), what, torch.float32
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32)
    return model, f"transformers' from_pretrained of {source.name}", torch.float32


def _has_zero_shards(source: Source) -> bool:
    return source.tag is not None and any((source.path / source.tag).glob("*zero_pp_rank_*_optim_states.pt"))


def export_model(export_dir: Path, kind: str, facts: RunFacts) -> torch.nn.Module:
    import torch

    if kind == "adapter":
        from peft import PeftModel

        return PeftModel.from_pretrained(_base_model(facts), str(export_dir))
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32)


# ------------------------------------------------------------------------------------------------- the proof


def prove(
    export_dir: Path, source: Source, facts: RunFacts, kind: str, dtype: str, probe: Path | None = None
) -> Verdict:
    """Compare the export's logits with the independent path's, and with the live model's (``probe``, or for
    ``final/`` the run's own ``RUN/ftkit/probe.json``, written by the built-in entry after training).

    Loads one model at a time: the reference (its logits kept, the model dropped), then the export.
    """
    import torch
    from transformers import AutoConfig

    t0 = time.monotonic()
    verdict = Verdict(dtype)
    with quiet():
        cfg_dir = facts.model_path if kind == "adapter" else str(export_dir)
        config = AutoConfig.from_pretrained(
            cfg_dir, **({"revision": facts.model_revision} if kind == "adapter" and facts.model_revision else {})
        )
        # the live model's logits to judge against: the given probe, or final/'s own (the run's probe.json is
        # written with the final model); any other checkpoint still borrows the run's probe tokens as input
        run_probe = _read_probe(probe) if probe is not None else None
        if probe is None and source.name == "final":
            run_probe = _run_probe(source.run_dir)
        probe_input = run_probe or _run_probe(source.run_dir)
        batches = probe_batches(config.vocab_size, getattr(config, "max_position_embeddings", None), probe_input)

        ref, what, held = reference_model(source, facts, kind)
        exact = logits_of(ref, batches)
        target = torch_dtype(dtype)
        rounded = exact
        if target != torch.float32:
            round_to(ref, target, only_lora=(kind == "adapter"))
            rounded = logits_of(ref, batches)
        del ref
        gc.collect()

        model = export_model(export_dir, kind, facts)
        got = logits_of(model, batches)
        coarse = held.itemsize < target.itemsize  # e.g. a bf16 run's ZeRO-0 module against an fp32 export
        if coarse:
            round_to(model, held, only_lora=(kind == "adapter"))
            got_held = logits_of(model, batches)
        del model
        gc.collect()

    tokens = sum(int(b.numel()) for b in batches)
    held_name = str(held).removeprefix("torch.")
    if coarse:
        name = f"{what}, held in {held_name} (the export rounded alike)"
        verdict.checks.append(Check(name, max_diff(got_held, exact), FP32_ATOL, tokens))
        verdict.checks.append(
            Check(f"{what} ({held_name} against the {dtype} export)", max_diff(got, exact), None, tokens)
        )
    elif target == torch.float32:
        verdict.checks.append(Check(what, max_diff(got, exact), FP32_ATOL, tokens))
    else:
        verdict.checks.append(Check(f"{what}, weights rounded to {dtype}", max_diff(got, rounded), FP32_ATOL, tokens))
        verdict.checks.append(Check(f"{what} in fp32 ({dtype} rounding)", max_diff(got, exact), None, tokens))
    if run_probe is not None:
        live = torch.tensor(run_probe["logits"], dtype=torch.float32)
        if live.shape == got[0].shape:
            judged = target == torch.float32 and facts.precision == "fp32"
            where = "RUN/ftkit/probe.json" if probe is None else str(probe)
            ref_name = f"the live trained model's logits at the end of training ({where})"
            verdict.checks.append(
                Check(ref_name, float((got[0] - live).abs().max()), FP32_ATOL if judged else None, int(live.shape[1]))
            )
    verdict.seconds = round(time.monotonic() - t0, 2)
    verdict.verified_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return verdict
