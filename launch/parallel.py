"""Sequence parallelism on the ranks (DeepSpeed's ALST/Ulysses through HF Trainer and Accelerate).

* :func:`parallelism_args`: TrainingArguments' ``parallelism_config`` from the run spec's ``parallel`` part;
* :func:`install_sequence_parallel`: what HF Trainer's Ulysses path needs to resume exactly
  (:class:`EpochAdapter`), installed on every rank of an SP run whatever its entry.

Tensor parallelism needs nothing here: HF Trainer calls DeepSpeed AutoTP (``deepspeed.tp_model_init``) from
ds_config.json's ``tensor_parallel``, and ftkit's checkpoint checks read AutoTP's per-TP-rank shards.

Standard library only at import time.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, cast

from ftkit.launch.rank import on_import
from ftkit.rundir.spec import RunSpec


def sp_degree(spec: RunSpec) -> int:
    """The sequence-parallel degree of the run (1: none)."""
    return spec.parallel["sp"] if spec.parallel else 1


def parallelism_args(spec: RunSpec) -> dict[str, object]:
    """TrainingArguments' ``parallelism_config`` for sequence parallelism: Accelerate's ParallelismConfig with
    DeepSpeed's ALST/Ulysses handler, from which HF Trainer splits each batch's sequence over the SP group and
    computes the loss over it. ``accelerate launch`` would also build it from accelerate.yaml; the deepspeed launcher
    and torchrun do not, so the ranks build it from the same plan."""
    p = spec.parallel
    if p is None or sp_degree(spec) <= 1:
        return {}
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation=p["sp_attn_implementation"]
    )
    config = ParallelismConfig(sp_size=p["sp"], sp_backend="deepspeed", dp_replicate_size=p["dp"], sp_handler=handler)
    return {"parallelism_config": config}


def install_sequence_parallel() -> None:
    """Every rank of an SP run: Accelerate wraps HF Trainer's data loader in :class:`EpochAdapter`, and HF Trainer's
    mid-epoch resume skips through it (:func:`skip_first_batches`)."""
    on_import("accelerate.accelerator", _adapt_accelerator)
    on_import("transformers.trainer", _adapt_trainer)


if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.nn import Module
    from torch.utils.data import DataLoader


def _adapt_accelerator(mod: types.ModuleType) -> None:
    def deepspeed_ulysses_dl_adapter(self: Accelerator, dl: DataLoader[object], model: Module) -> object:
        sp_size = self.parallelism_config.sp_size if self.parallelism_config else 1
        if sp_size == 1:
            return dl
        from deepspeed.utils import groups

        return epoch_adapter_class()(
            dl,
            sp_rank=groups._get_sequence_parallel_rank(),
            sp_group=groups._get_sequence_parallel_group(),
            sp_world_size=groups._get_sequence_parallel_world_size(),
            device=model.device,
        )

    mod.Accelerator.deepspeed_ulysses_dl_adapter = deepspeed_ulysses_dl_adapter


def _adapt_trainer(mod: types.ModuleType) -> None:
    original = mod.skip_first_batches

    def skip_first_batches(dataloader: object, num_batches: int = 0) -> object:
        if isinstance(dataloader, epoch_adapter_class()):
            return dataloader.without_first(num_batches)  # type: ignore[attr-defined]  # EpochAdapter's own
        return original(dataloader, num_batches)

    mod.__dict__["skip_first_batches"] = skip_first_batches  # the name transformers.trainer calls


_ADAPTER: type | None = None


def epoch_adapter_class() -> type:
    """:class:`EpochAdapter`, built on first use (it subclasses DeepSpeed's adapter, which imports torch)."""
    global _ADAPTER
    if _ADAPTER is None:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        class EpochAdapter(UlyssesSPDataLoaderAdapter):  # type: ignore[misc]
            """DeepSpeed's Ulysses data-loader adapter (each batch of every SP rank, gathered and split over the
            sequence: sp micro-batches per batch) that behaves like the loader it wraps across epochs and resumes.

            DeepSpeed's keeps the iterator it made when built and renews it only on running dry, and forwards no
            ``set_epoch``: an uninterrupted run met an empty epoch after the first and drew the next order from
            another epoch's seed than a run resumed at that epoch (measured: the step after a resume 5.430 against
            5.484 uninterrupted), and HF Trainer's mid-epoch skip cannot read it (no ``dataset``). Here each
            ``iter()`` starts the wrapped loader afresh, as HF Trainer expects of a loader at each epoch,
            ``set_epoch`` reaches its sampler, and :meth:`without_first` skips whole batches of the wrapped loader
            and the rest of one batch's micro-batches."""

            skip_micro = 0

            def __iter__(self) -> EpochAdapter:
                self.iter = iter(self.dl)
                self.micro_batches.clear()
                for _ in range(self.skip_micro):
                    next(self)
                return self

            def set_epoch(self, epoch: int) -> None:
                for target in (self.dl, getattr(getattr(self.dl, "batch_sampler", None), "batch_sampler", None)):
                    set_epoch = getattr(target, "set_epoch", None)
                    if set_epoch is not None:
                        set_epoch(epoch)

            def without_first(self, micro_batches: int) -> EpochAdapter:
                from accelerate.data_loader import skip_first_batches

                whole, rest = divmod(micro_batches, self.sp_world_size)
                out = type(self)(
                    skip_first_batches(self.dl, whole),
                    sp_rank=self.sp_rank,
                    sp_group=self.sp_group,
                    sp_world_size=self.sp_world_size,
                    device=self.device,
                )
                out.skip_micro = rest
                return cast(EpochAdapter, out)

        _ADAPTER = EpochAdapter
    return _ADAPTER
