"""The HF ``TrainerCallback`` that carries ftkit's per-rank services (:func:`ftkit.hf.callbacks` builds it).

Heartbeats and metrics on HF Trainer's own events, commit records after every save, the graceful stop (one
all-reduce per optimizer step, so every rank saves the same step), each rank's own compute time per step (for
straggler detection), and after a resume the changes the user allowed (:func:`apply_resume_overrides`).
Importing this module does not import transformers: the class is built on first use (:func:`callback_class`).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ftkit.checkpoint.commit import manifest_part, write_commit
from ftkit.checkpoint.directory import record_save_begun, rotate
from ftkit.errors import ExitCode, FsdpNotOn, SaveWroteNothing
from ftkit.launch.rank import Fault, fsdp2_proof
from ftkit.rundir.layout import append_jsonl
from ftkit.rundir.spec import RANK_APPLIED

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import TrainOutput

    from ftkit.launch.services import _Rank
    from ftkit.rundir.records import JSON, FileEntry, MetricsRecord

    class FtkitCallbackType(TrainerCallback):
        """The type checker's view of the class :func:`callback_class` builds on first use."""

        def __init__(self, r: _Rank, fault: Fault, exit_after_stop: bool = True) -> None: ...


def _output_dir(args: TrainingArguments) -> str:
    return cast(str, args.output_dir)  # TrainingArguments.__post_init__ sets it (typed str | None)


COMPUTE_EWMA = 0.2  # weight of the newest step in the per-rank compute-time average


_CALLBACK: type[FtkitCallbackType] | None = None


def _device_memory() -> MetricsRecord:
    """This rank's CUDA allocator peaks so far (bytes), or nothing off a GPU: ``mem_peak`` (max_memory_allocated)
    and ``mem_reserved_peak`` (max_memory_reserved, with the caching allocator's slack)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {
        "mem_peak": int(torch.cuda.max_memory_allocated()),
        "mem_reserved_peak": int(torch.cuda.max_memory_reserved()),
    }


def callback_class() -> type[FtkitCallbackType]:
    global _CALLBACK
    if _CALLBACK is not None:
        return _CALLBACK
    from transformers import TrainerCallback

    class FtkitCallback(TrainerCallback):
        """Heartbeat, metrics, commit records, graceful stop and resume overrides, on HF Trainer's own events."""

        def __init__(self, r: _Rank, fault: Fault, exit_after_stop: bool = True):
            self.r, self.ctx, self.spec, self.fault = r, r.ctx, r.spec, fault
            self.exit_after_stop = exit_after_stop
            self._t0: float | None = None
            self._compute = 0.0
            self._hooked = False
            self._save_t0: float | None = None

        # ------------------------------------------------------------------ lifecycle

        def on_train_begin(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
        ) -> None:
            if args.max_steps > 0 and state.global_step >= args.max_steps:
                # Resumed from a checkpoint at the recipe's last step (a crash in the final save, final/ removed):
                # HF would train one more step before checking. The weights are loaded: stop here, the caller's
                # Trainer.train returns (train_guard) and the final model is saved from them.
                self.ctx.started_at_step = state.global_step
                self.ctx.heartbeat("train", state.global_step)
                raise AtMaxSteps(state.global_step, args.max_steps)
            overrides = self.spec.resume_overrides
            if self.r.resume and overrides:  # after the checkpoint's optimizer and scheduler state were loaded
                optimizer = cast("torch.optim.Optimizer", kw.get("optimizer"))  # HF passes the Trainer's own
                for line in apply_resume_overrides(overrides, optimizer, kw.get("lr_scheduler")):
                    print(f"ftkit: resume override {line}", flush=True)
            if self.spec.backend == "fsdp2":
                self._prove_fsdp2(cast("torch.nn.Module | None", kw.get("model")), state.global_step)
            self._hook_forward(cast("torch.nn.Module | None", kw.get("model")))
            self.ctx.started_at_step = state.global_step  # in every heartbeat from now on: the resume proof
            self.ctx.heartbeat("train", state.global_step)
            if self.r.trackers is not None:
                try:
                    self.r.trackers.start_attempt(self.ctx.rank, state.global_step)
                except Exception as e:  # noqa: BLE001 - a tracker's trouble never ends the training
                    print(f"ftkit: warning: could not record the attempt on the tracker run: {e}", flush=True)
            # DeepSpeed has built its ops by now: back to dying at once on SIGTERM, so a rank blocked in a
            # collective (a dead peer) does not hold teardown for its whole grace period.
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

        def on_step_begin(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
        ) -> None:
            self._compute = 0.0

        def on_step_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
        ) -> None:
            if self._hooked and self._compute > 0:
                c = self._compute
                e = self.ctx.compute_ewma_s
                self.ctx.compute_ewma_s = c if e is None else (1 - COMPUTE_EWMA) * e + COMPUTE_EWMA * c
                self.ctx.compute_n += 1
            if args.max_steps > 0 and state.global_step > args.max_steps:  # never: on_train_begin stops first
                raise RuntimeError(f"ftkit: step {state.global_step} is beyond train.max_steps={args.max_steps}")
            self.ctx.heartbeat("train", state.global_step)
            self.fault.after_step(state.global_step)
            if self.r.stop.stopped_at is None and self.r.stop.agreed(getattr(args, "device", None)):
                self.r.stop.stopped_at = state.global_step
                control.should_save = True  # this step, on every rank: then the loop ends
                control.should_training_stop = True
                print(f"ftkit: stop requested: saving step {state.global_step}, then stopping", flush=True)
            self._before_save(args, state, control)

        def on_epoch_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
        ) -> None:
            self._before_save(args, state, control)

        def _before_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> None:
            """The Trainer saves right after these events when ``should_save`` is set (HF's own flow callback ran
            first): record that ftkit began this save, so a torn checkpoint-N is known to be ftkit's own."""
            if control.should_save:
                self._save_t0 = time.time()  # what a save blocks the ranks for: from here to the commit's end
                where = self.r.tier.dir if self.r.tier is not None else _output_dir(args)
                record_save_begun(where, state.global_step, self.ctx.attempt)

        def on_log(
            self,
            args: TrainingArguments,
            state: TrainerState,
            control: TrainerControl,
            logs: dict[str, float] | None = None,
            **kw: object,
        ) -> None:
            logs = logs or {}
            rec: MetricsRecord | None = None
            if "loss" in logs:
                self.ctx.last_loss = float(logs["loss"])
                rec = {
                    "step": state.global_step,
                    "loss": self.ctx.last_loss,
                    "lr": logs.get("learning_rate"),
                    "grad_norm": logs.get("grad_norm"),
                    "tokens_seen": getattr(state, "num_input_tokens_seen", None) or None,
                }
            elif "eval_loss" in logs:
                rec = {"step": state.global_step, "eval_loss": float(logs["eval_loss"])}
            if rec is not None and "loss" in logs:
                rec.update(_device_memory())  # on a GPU: what ftkit plan predicts, measured (make gpu-check)
            if rec is not None and self.ctx.rank == 0:
                append_jsonl(self.ctx.rd.metrics, {**rec, "attempt": self.ctx.attempt, "time": time.time()})
            self.ctx.heartbeat("train", state.global_step)
            if "loss" in logs:
                self.fault.after_log(state.global_step)

        def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object) -> None:
            import torch.distributed as dist

            tier = self.r.tier
            ckpt = (tier.dir if tier is not None else Path(_output_dir(args))) / f"checkpoint-{state.global_step}"
            if not ckpt.is_dir():  # every rank sees the shared directory: all of them stop, none waits in a gather
                self._save_wrote_nothing(ckpt)
            if tier is not None:
                self._commit_local(args, state)
                return
            t0 = time.time()
            part = manifest_part(ckpt, self.ctx.rank, self.ctx.world_size, checksum=self.spec.resilience.checksum)
            parts: list[dict[str, FileEntry] | None] = [None] * self.ctx.world_size
            if dist.is_available() and dist.is_initialized():
                dist.all_gather_object(parts, part)  # every rank has finished writing: this is the barrier
            else:
                parts = [part]
            if self.ctx.rank == 0:
                write_commit(
                    ckpt,
                    cast("list[dict[str, FileEntry]]", parts),  # every rank's, after the gather
                    step=state.global_step,
                    world_size=self.ctx.world_size,
                    stage=self.spec.stage,
                    recipe_hash=self.spec.recipe_hash,
                    extra={"attempt": self.ctx.attempt, "fingerprint": self.spec.fingerprint},
                )
                removed = self._rotate(_output_dir(args))
                append_jsonl(
                    self.ctx.rd.metrics,
                    {
                        "event": "commit",
                        "step": state.global_step,
                        "commit_s": round(time.time() - t0, 3),
                        "attempt": self.ctx.attempt,
                        "rotated": [str(p) for p in removed],
                        "stop": self.r.stop.stopped_at == state.global_step or None,
                        "time": time.time(),
                    },
                )
            if dist.is_available() and dist.is_initialized():
                dist.barrier()  # nobody trains on (or dies) before the commit is on disk
            self.ctx.heartbeat("train", state.global_step, committed=state.global_step)

        def _commit_local(self, args: TrainingArguments, state: TrainerState) -> None:
            """A save to the node-local tier (ftkit.launch.tier): committed per node; the agents copy it to the run
            directory when due. A graceful stop's save waits (bounded) for that copy before the rank exits."""
            step = state.global_step
            stop = self.r.stop.stopped_at == step
            done = self.r.tier.commit(self.ctx, self.spec, step, stop)
            if self._save_t0 is not None:
                done["save_s"] = round(time.time() - self._save_t0, 3)
            if self.ctx.rank == 0:
                append_jsonl(
                    self.ctx.rd.metrics,
                    {
                        "event": "commit",
                        "step": step,
                        "attempt": self.ctx.attempt,
                        **done,
                        "stop": stop or None,
                        "time": time.time(),
                    },
                )
            self.ctx.heartbeat("train", step, committed=step)
            if stop:
                timeout = 0.7 * self.r.stop.timeout_s()  # within the supervisor's own bound
                if self.r.tier.wait_durable(Path(_output_dir(args)), step, timeout):
                    print(f"ftkit: step {step} is durable in the run directory", flush=True)
                else:
                    print(
                        f"ftkit: warning: step {step} was not copied to the run directory within {timeout:g} s; "
                        "the local tier keeps it",
                        flush=True,
                    )

        def _prove_fsdp2(self, model: torch.nn.Module | None, step: int) -> None:
            """FSDP2 really on in this rank (its parameters are DTensors), recorded in every heartbeat; else the
            rank stops at once (a restart would run plain data parallel again)."""
            try:
                self.ctx.sharding = fsdp2_proof(model)
            except FsdpNotOn as e:
                self.ctx.record_error(e, step=step, repeats=True)
                print(f"ftkit: error: {e}", file=sys.stderr, flush=True)
                raise SystemExit(ExitCode.SCRIPT_FAILED) from None
            print(
                f"ftkit: FSDP2 is on: {self.ctx.sharding['dtensor_params']} of {self.ctx.sharding['params']} "
                "parameters are DTensors",
                flush=True,
            )

        def _save_wrote_nothing(self, ckpt: Path) -> None:

            e = SaveWroteNothing(
                f"rank {self.ctx.rank}: the Trainer's save wrote nothing at {ckpt} (does the script's Trainer override "
                "_save_checkpoint?): there is no checkpoint to commit, and every save would do the same"
            )
            if self.ctx.rank == 0:
                self.ctx.record_error(e, step=int(ckpt.name.rsplit("-", 1)[1]), repeats=True)
            print(f"ftkit: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(ExitCode.SCRIPT_FAILED)

        def _rotate(self, output_dir: str) -> list[Path]:
            """Rotation never ends a rank: a checkpoint it cannot delete stays, and the rank says why."""
            try:
                return rotate(output_dir, self.spec.save_total_limit, note=lambda line: print(f"ftkit: {line}"))
            except OSError as e:
                print(f"ftkit: warning: rotation stopped: {e.filename or output_dir}: {e.strerror or e}", flush=True)
                return []

        def on_train_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
        ) -> None:
            if self.r.stop.stopped_at is None:
                return
            self.ctx.heartbeat("stopped", state.global_step, committed=self.r.stop.stopped_at)
            self.r.stop.finished.set()
            print(f"ftkit: stopped on request after committing step {self.r.stop.stopped_at}", flush=True)
            if self.exit_after_stop:
                sys.stdout.flush()
                raise SystemExit(0)

        # ------------------------------------------------------------------ compute time (stragglers)

        def _hook_forward(self, model: torch.nn.Module | None) -> None:
            """Time the model's forward passes on this rank's own clock. Under DDP and ZeRO-1/2 a forward holds no
            collective, so a slow host shows up here and not in the (lock-step) step time; under ZeRO-3 the
            forward also waits for parameter gathers."""
            if model is None or self._hooked:
                return

            def pre(module: torch.nn.Module, inputs: tuple[object, ...]) -> None:
                self._t0 = time.perf_counter()

            def post(module: torch.nn.Module, inputs: tuple[object, ...], output: object) -> None:
                if self._t0 is not None:
                    self._compute += time.perf_counter() - self._t0
                    self._t0 = None

            model.register_forward_pre_hook(pre)
            model.register_forward_hook(post)
            self._hooked = True

    _CALLBACK = cast("type[FtkitCallbackType]", FtkitCallback)
    return _CALLBACK


class AtMaxSteps(Exception):  # noqa: N818 - a signal to train_guard, not an error
    """Raised by the callback when training resumes at ``max_steps``: nothing is left to train."""

    def __init__(self, step: int, max_steps: int):
        super().__init__(f"resumed at step {step}, train.max_steps={max_steps}: nothing left to train")
        self.step = step


def install_train_guard() -> None:
    """Wrap ``transformers.Trainer.train`` once (every entry: the built-in one, the import hook, ``ftkit.hf``):
    a run resumed at ``max_steps`` returns from ``train()`` with the checkpoint loaded and no step taken, so the
    caller saves the final model from it (an uninterrupted run's final model, bit for bit)."""
    import functools

    from transformers import Trainer
    from transformers.trainer_utils import TrainOutput

    if getattr(Trainer.train, "_ftkit_guard", False):
        return
    original = Trainer.train

    @functools.wraps(original)
    def train(self: Trainer, *args: Any, **kwargs: Any) -> TrainOutput:
        try:
            return original(self, *args, **kwargs)
        except AtMaxSteps as e:
            print(f"ftkit: {e}: the final model is saved from the checkpoint as it is", flush=True)
            return TrainOutput(e.step, 0.0, {})

    train._ftkit_guard = True  # type: ignore[attr-defined]
    Trainer.train = train  # type: ignore[method-assign]  # the guard wraps transformers' own Trainer.train once


def _lr_scheduler_of(lr_scheduler: object) -> LRScheduler | None:
    """The torch LR scheduler inside Accelerate's/DeepSpeed's wrappers (the object with ``base_lrs``)."""
    seen = 0
    while lr_scheduler is not None and not hasattr(lr_scheduler, "base_lrs") and seen < 4:
        lr_scheduler = getattr(lr_scheduler, "scheduler", None) or getattr(lr_scheduler, "lr_scheduler", None)
        seen += 1
    return cast("LRScheduler", lr_scheduler) if hasattr(lr_scheduler, "base_lrs") else None


def _deepspeed_schedule(lr_scheduler: object) -> Any:
    """DeepSpeed's own schedule (deepspeed.runtime.lr_schedules: WarmupLR ... LRRangeTest) inside the wrappers, or
    None: it keeps ``last_batch_iteration`` and computes its rates from its config (``get_lr``)."""
    seen = 0
    while lr_scheduler is not None and seen < 4:
        if hasattr(lr_scheduler, "last_batch_iteration") and hasattr(lr_scheduler, "get_lr"):
            return lr_scheduler
        lr_scheduler = getattr(lr_scheduler, "scheduler", None) or getattr(lr_scheduler, "lr_scheduler", None)
        seen += 1
    return None


def apply_resume_overrides(
    overrides: Mapping[str, JSON], optimizer: torch.optim.Optimizer, lr_scheduler: object
) -> list[str]:
    """Apply allowed changes of optimizer hyperparameters to a resumed run; return one line per change.

    Called after the checkpoint is loaded (HF Trainer's ``on_train_begin`` follows DeepSpeed's ``load_checkpoint``
    and ``_load_optimizer_and_scheduler`` in ``_inner_training_loop``): loading restores the *old* values into the
    optimizer's param groups (``lr``, ``initial_lr``, ``betas``, ``eps``, ``weight_decay``) and the scheduler's
    ``base_lrs``, so the new TrainingArguments alone are ignored. The schedule's shape (type, warm-up, horizon) is
    rebuilt from the current arguments by HF (LambdaLR keeps its lambdas, restores only its step and base lrs), so
    a new peak lr is applied by replacing ``base_lrs`` and recomputing the current lr at the restored step.
    Keys this function does not know took effect through the new spec (TrainingArguments, ds_config.json).
    """

    sched = _lr_scheduler_of(lr_scheduler)
    groups = sched.optimizer.param_groups if sched is not None else optimizer.param_groups
    lines: list[str] = []
    own = _deepspeed_schedule(lr_scheduler) if sched is None else None
    if "train.learning_rate" in overrides and own is not None:
        # DeepSpeed's own schedule (ds_config.json's scheduler block) was built from the new config and restored only
        # its step: its rates are the new ones from the next step; the restored param groups still hold the old rate
        lrs = list(own.get_lr())
        for g, lr in zip(own.optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        own._last_lr = lrs
        lines.append(f"train.learning_rate: DeepSpeed's {type(own).__name__} from ds_config.json; lr now {lrs[0]}")
    elif "train.learning_rate" in overrides:
        new = float(cast(float, overrides["train.learning_rate"]))  # the recipe checked it is a number
        if sched is None:
            raise RuntimeError("resume override train.learning_rate: no LR scheduler with base_lrs to update")
        old = list(sched.base_lrs)
        sched.base_lrs = [new for _ in sched.base_lrs]  # HF gives every param group the same peak lr
        for g in groups:
            g["initial_lr"] = new
        lambdas = getattr(sched, "lr_lambdas", None)
        if lambdas is not None:  # every schedule ftkit offers is a LambdaLR: lr = peak x lambda(step)
            lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, lambdas, strict=True)]
        else:  # any other scheduler: scale the current lr by the ratio of the peaks
            lrs = [g["lr"] * new / o if o else new for g, o in zip(groups, old, strict=True)]
        for g, lr in zip(groups, lrs, strict=True):
            g["lr"] = lr
        sched._last_lr = list(lrs)  # what HF logs as learning_rate until the next scheduler step
        lines.append(f"train.learning_rate: peak {old[0]} -> {new}; lr at step {sched.last_epoch} now {lrs[0]}")
    if "train.weight_decay" in overrides:
        new = float(cast(float, overrides["train.weight_decay"]))  # the recipe checked it is a number
        old_values = [g.get("weight_decay", 0.0) for g in groups]
        # A group with 0 beside groups that decay is a no-decay group (biases, norms): it stays at 0.
        decaying = [g for g, v in zip(groups, old_values, strict=True) if v != 0] or list(groups)
        for g in decaying:
            g["weight_decay"] = new
        lines.append(f"train.weight_decay: {old_values[0]} -> {new} ({len(decaying)}/{len(groups)} param groups)")
    if "train.adam_beta1" in overrides or "train.adam_beta2" in overrides:
        old_betas = tuple(groups[0]["betas"])
        for g in groups:
            b1, b2 = g["betas"]
            g["betas"] = (
                float(overrides.get("train.adam_beta1", b1)),
                float(overrides.get("train.adam_beta2", b2)),
            )
        lines.append(f"train.adam_beta1/2: {old_betas} -> {tuple(groups[0]['betas'])}")
    if "train.adam_epsilon" in overrides:
        new = float(cast(float, overrides["train.adam_epsilon"]))  # the recipe checked it is a number
        old_eps = groups[0].get("eps")
        for g in groups:
            g["eps"] = new
        lines.append(f"train.adam_epsilon: {old_eps} -> {new}")
    for key in sorted(set(overrides) - set(RANK_APPLIED)):
        lines.append(f"{key}: {overrides[key]!r} (applied through the new spec)")
    return lines
