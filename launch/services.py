"""ftkit's per-rank services for any training script; their public face is :mod:`ftkit.hf`.

Under ``ftkit launch`` every rank finds its run in the environment: ``FTKIT_RUN_DIR`` (the run directory),
``FTKIT_ATTEMPT`` and ``FTKIT_RESUME`` (the checkpoint ftkit chose, verified; empty for a fresh start). A script
that wants to be explicit (``ftkit launch --no-inject``) uses::

    import ftkit.hf
    args = ftkit.hf.training_arguments(my_option=...)       # the recipe's values, plus yours where it is silent
    trainer = Trainer(model, args, train_dataset=..., callbacks=ftkit.hf.callbacks())
    trainer.train(resume_from_checkpoint=ftkit.hf.resume_checkpoint())

An unmodified script gets the same through the import hook (:mod:`ftkit.launch.hook`), and the built-in entry
(``ftkit.launch.train``) is one more client. So there is one code path for:

* **commit records**: after each checkpoint save all ranks all-gather a manifest of the files they wrote (the
  gather is also the barrier), then rank 0 writes ``ftkit_commit.json`` atomically; a checkpoint without one is
  torn and never resumed from. Rotation (``save_total_limit``) is ftkit's, counting committed ones only.
* **heartbeats** (``ftkit/heartbeat/rank-R.json``, every step: phase, step, loss, and the rank's own compute time
  per step for straggler detection) and ``metrics.jsonl`` (rank 0: loss, lr, grad norm, tokens seen, eval loss).
* **pid records** for teardown by pid, one log file per rank per attempt, and the supervisor watchdog.
* **graceful stop**: when the supervisor asks (``ftkit/stop.json``, written on SIGTERM/SIGINT/SIGHUP/SIGUSR1 or
  ``ftkit stop``) or the rank's watchdog finds its supervisor gone, every rank takes part in one all-reduce per
  optimizer step, so all of them see the request at the *same* step; that step is saved and committed as usual,
  then training stops. A relaunch resumes from it: no step is recomputed.
* **resume** from the checkpoint the supervisor chose (never HF's ``get_last_checkpoint``), with the changes the
  user allowed (``--allow-changes``) applied after the checkpoint's optimizer and scheduler state were loaded.

Importing this module is cheap (no torch or transformers until a function needs them).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast, overload

from ftkit.checkpoint.commit import manifest_part, write_commit
from ftkit.checkpoint.directory import record_save_begun, rotate
from ftkit.checkpoint.layout import model_weights
from ftkit.checkpoint.tiers import for_node
from ftkit.errors import ExitCode, FtkitError, SaveWroteNothing
from ftkit.launch.callback import COMPUTE_EWMA, apply_resume_overrides, callback_class, install_train_guard
from ftkit.launch.parallel import install_sequence_parallel, sp_degree
from ftkit.launch.rank import (
    Fault,
    RankContext,
    StopRequest,
    _env_int,
    _redirect_output,
    defer_full_collections,
    install_startup,
    leave_out,
    on_import,
    skip_final_collection,
    unused_imports,
)
from ftkit.launch.tier import local_tier
from ftkit.launch.trackers import Trackers, atomic_mlflow_run_info, guard_trackers
from ftkit.launch.watchdog import SupervisorWatchdog, remove_own_shm
from ftkit.rundir.env import ATTEMPT_ENV, FAULT_ENV, RESUME_ENV, RUN_DIR_ENV
from ftkit.rundir.layout import STOP_FILE, RunDir, append_jsonl, atomic_write, tensorboard_dir
from ftkit.rundir.spec import RunSpec

if TYPE_CHECKING:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ftkit.rundir.records import JSON, FileEntry, JSONObject

_Args = TypeVar("_Args", bound="TrainingArguments")
ArgChange: TypeAlias = "tuple[str, object, object]"  # (TrainingArguments field, old value, new value)

__all__ = [  # the public face; the rest is re-exported for the built-in entry and the hook
    "active",
    "apply",
    "callbacks",
    "checkpoint",
    "commit_final",
    "context",
    "final",
    "recipe_arguments",
    "record_changes",
    "resume_checkpoint",
    "resume_step",
    "save_final",
    "spec",
    "start",
    "step",
    "stopped_at",
    "training_arguments",
]
_reexported = (COMPUTE_EWMA, FAULT_ENV, STOP_FILE, RankContext, apply_resume_overrides)


class _Rank:
    """The per-process state behind the module functions (one run per process)."""

    def __init__(self, run_dir: Path, attempt: int, resume: str | None):
        self.spec = RunSpec.read(RunDir(run_dir).spec)
        self.ctx = RankContext(run_dir, attempt, self.spec)
        self.resume = for_node(resume, self.ctx.node_host) if resume else None  # a local tier's path names {host}
        self.tier = local_tier(self.spec, self.ctx)  # this node's local checkpoint tier, None: saves go to the run
        self.stop = StopRequest(self.ctx.rd, attempt)
        self.changes_recorded = False
        self.dog: SupervisorWatchdog | None = None  # the supervisor watchdog (None: no supervisor owns the run)
        self.fault: Fault | None = None  # test fault injection for a loop that calls step()
        self.trackers: Trackers | None = None  # wandb/mlflow/...: one run across attempts
        self.final_step: int | None = None  # set once final/ is committed by this rank's run
        self.outcome_recorded = False  # an orphaned run's outcome, written once


_rank: _Rank | None = None
_lock = threading.Lock()


def active() -> bool:
    """True on a rank started by ``ftkit launch`` (``FTKIT_RUN_DIR`` is set)."""
    return _rank is not None or bool(os.environ.get(RUN_DIR_ENV))


def start(
    run_dir: str | os.PathLike[str] | None = None,
    attempt: int | None = None,
    resume: str | None = None,
    *,
    log_to_console: bool = False,
) -> RankContext:
    """Per-process set-up, once: the rank's log file, pid record, first heartbeat and supervisor watchdog.

    Arguments default to the environment ``ftkit launch`` sets; idempotent (later calls return the context).
    """
    global _rank
    with _lock:
        if _rank is not None:
            return _rank.ctx
        if run_dir is None:
            run_dir = os.environ.get(RUN_DIR_ENV)
            if not run_dir:
                raise RuntimeError(f"ftkit.hf: not started by ftkit launch ({RUN_DIR_ENV} is not set)")
        if attempt is None:
            attempt = _env_int(ATTEMPT_ENV)
        if resume is None:
            resume = os.environ.get(RESUME_ENV) or None
        r = _Rank(Path(run_dir), attempt, resume)
        atexit.register(skip_final_collection)  # the rank's first exit handler, so it runs after every other
        defer_full_collections()  # until training begins
        if r.spec.command is None:  # the built-in entry: no user code that could import them itself
            leave_out(unused_imports(r.spec.training_args["report_to"], lora=bool(r.spec.peft)))
        if "tensorboard" in r.spec.training_args["report_to"]:
            # transformers 5.x has no logging_dir: its TensorBoard callback reads this variable (run directory only)

            os.environ.setdefault("TENSORBOARD_LOGGING_DIR", tensorboard_dir(r.spec.training_args["output_dir"]))
        if not log_to_console:
            _redirect_output(r.ctx.rd.rank_log(attempt, r.ctx.rank))
        watched = _watch_supervisor(r)
        r.ctx.record_pid(watchdog=watched)
        r.ctx.heartbeat("starting")
        atexit.register(_at_exit, r)
        install_startup(r.spec.accelerator, r.ctx.rd.batons, r.spec.backend)
        if sp_degree(r.spec) > 1:
            install_sequence_parallel()
        if r.tier is not None:
            r.tier.start(r.ctx)
            on_import("transformers.trainer", r.tier.patch_trainer)
        r.trackers = Trackers(r.ctx.rd, attempt, r.resume)
        for key, value in r.trackers.environment().items():
            os.environ.setdefault(key, value)  # before any tracker starts; the user's own values win
        on_import("transformers.integrations.integration_utils", guard_trackers(r.trackers))
        on_import("mlflow.store.tracking.file_store", atomic_mlflow_run_info)
        _rank = r
    print(
        f"ftkit rank {r.ctx.rank}/{r.ctx.world_size} on {r.ctx.host} pid {os.getpid()} attempt {attempt} "
        f"resume={r.resume}",
        flush=True,
    )
    return r.ctx


def _state() -> _Rank:
    start()
    assert _rank is not None
    return _rank


def context() -> RankContext:
    return _state().ctx


def spec() -> RunSpec:
    return _state().spec


def write_paths() -> list[Path]:
    """Where this rank writes checkpoints: the run directory and, with a local tier, this node's tier directory (a
    failed write that filled one of them is named by it: exit 12)."""
    r = _state()
    return [r.ctx.rd.path, *([r.tier.dir] if r.tier is not None else [])]


def resume_checkpoint() -> str | None:
    """The checkpoint ftkit chose and verified for this attempt (None: a fresh start). Pass it to
    ``trainer.train(resume_from_checkpoint=...)``."""
    return _state().resume


def recipe_arguments() -> dict[str, object]:
    """The TrainingArguments values the recipe states (the source of truth for them); everything else stays the
    script's. The built-in entry uses all of ``spec.training_args``."""
    s = _state().spec
    args: Mapping[str, object] = s.training_args
    return {k: args[k] for k in s.stated_args if k in args}


@overload
def training_arguments(cls: None = None, **overrides: Any) -> TrainingArguments: ...
@overload
def training_arguments(cls: type[_Args], **overrides: Any) -> _Args: ...
def training_arguments(cls: type[TrainingArguments] | None = None, **overrides: Any) -> TrainingArguments:
    """``TrainingArguments`` (or ``cls``, e.g. TRL's ``SFTConfig``) with the recipe's values; ``overrides`` fill in
    what the recipe does not state (they go to ``cls`` as they are). An override of a value the recipe states
    loses, and is listed."""
    if cls is None:
        from transformers import TrainingArguments

        cls = TrainingArguments
    stated = recipe_arguments()
    kwargs = {**overrides, **stated}
    changes = [(k, overrides[k], stated[k]) for k in overrides if k in stated and overrides[k] != stated[k]]
    record_changes(changes)
    return cls(**kwargs)


def apply(args: _Args) -> tuple[_Args, list[ArgChange]]:
    """A copy of ``args`` (TrainingArguments or a subclass) with the recipe's values, and ``(name, old, new)`` for
    each value that changed. ``dataclasses.replace`` runs ``__post_init__`` again, so derived state (the DeepSpeed
    config object, the device) follows the new values."""
    stated = recipe_arguments()
    fields = {f.name for f in dataclasses.fields(args) if f.init}
    new = {k: v for k, v in stated.items() if k in fields}
    changes: list[ArgChange] = [
        (k, getattr(args, k, None), v) for k, v in new.items() if _differs(getattr(args, k, None), v)
    ]
    if not changes:
        return args, []
    replacements: dict[str, Any] = {k: v for k, _, v in changes}  # the recipe's values, to TrainingArguments
    return dataclasses.replace(args, **replacements), changes


def _differs(old: object, new: object) -> bool:
    old = getattr(old, "value", old)  # enums (save_strategy, lr_scheduler_type) compare by value
    return old != new


def record_changes(changes: Sequence[ArgChange]) -> None:
    """Rank 0 writes the TrainingArguments values ftkit changed to ``ftkit/attempts/N/args_changes.json``; the
    supervisor lists each once (``name: from -> to``) and puts them in events.jsonl."""
    r = _state()
    if r.ctx.rank != 0 or not changes:
        return
    path = r.ctx.rd.attempt_dir(r.ctx.attempt) / "args_changes.json"
    old: list[JSONObject] = []
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    seen = {c["name"] for c in old}
    rows = old + [{"name": n, "from": _jsonable(a), "to": _jsonable(b)} for n, a, b in changes if n not in seen]
    atomic_write(path, json.dumps(rows, indent=1, default=str))


def _jsonable(v: object) -> JSON:
    v = getattr(v, "value", v)
    return v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)


def callbacks(*, exit_after_stop: bool = True) -> list[TrainerCallback]:
    """The HF ``TrainerCallback`` that carries every per-rank service. ``exit_after_stop``: after a graceful stop
    end the process (exit 0) when ``trainer.train()`` returns, so a script does not go on to save a "final" model
    from a run stopped half-way; the built-in entry handles the stop itself."""
    r = _state()
    fault = Fault(os.environ.get(FAULT_ENV), r.ctx)
    fault.install_save_kill()
    install_train_guard()
    r.ctx.trainer_built = True
    r.ctx.heartbeat("loading")
    return [callback_class()(r, fault, exit_after_stop=exit_after_stop)]


# ------------------------------------------------------------------------------------------------ any training loop
# For a loop without HF Trainer (plain PyTorch, accelerate.Accelerator): the same services, called by the loop.


def resume_step() -> int | None:
    """The step of the checkpoint ftkit chose for this attempt (None: a fresh start): continue after it."""
    path = _state().resume
    if not path:
        return None
    name = Path(path).name
    return int(name.rsplit("-", 1)[1]) if name.rsplit("-", 1)[-1].isdigit() else None


def step(step: int, loss: float | None = None, **metrics: float) -> bool:
    """Call on every rank after each optimizer step: the heartbeat (hang detection), the loss in metrics.jsonl (rank
    0, every ``train.logging_steps``), test fault injection, and the graceful stop. Returns True when the run must
    stop: save this step (:func:`checkpoint`), then leave the loop; every rank gets the same answer (one all-reduce
    of a flag). Never past ``train.max_steps``."""
    r = _state()
    ctx = r.ctx
    max_steps = int(r.spec.training_args["max_steps"])
    if max_steps > 0 and step > max_steps:
        raise RuntimeError(f"ftkit.hf.step({step}): beyond train.max_steps={max_steps}")
    if loss is not None:
        ctx.last_loss = float(loss)
    ctx.loop_api = True
    if ctx.started_at_step is None:
        ctx.started_at_step = step - 1  # the step the loop continued from (the resume proof)
    ctx.heartbeat("train", step)
    every = int(r.spec.training_args["logging_steps"])
    if ctx.rank == 0 and loss is not None and step % max(every, 1) == 0:
        rec = {"step": step, "loss": float(loss), **{k: float(v) for k, v in metrics.items()}}
        append_jsonl(ctx.rd.metrics, {**rec, "attempt": ctx.attempt, "time": time.time()})
    _fault(r).after_log(step)
    _fault(r).after_step(step)
    if r.stop.stopped_at is None and r.stop.agreed():
        r.stop.stopped_at = step
        print(f"ftkit: stop requested: save step {step}, then stop", flush=True)
        return True
    return False


@contextlib.contextmanager
def checkpoint(step: int) -> Iterator[Path]:
    """``with ftkit.hf.checkpoint(step) as path: accelerator.save_state(path)`` on every rank: the save goes to
    ``RUN/checkpoint-<step>``, then every rank's files are hashed, rank 0 writes the commit record and rotates
    (``train.save_total_limit``). Only a committed checkpoint is ever resumed from (:func:`resume_checkpoint`)."""

    r = _state()
    ctx, spec = r.ctx, r.spec
    path = ctx.rd.path / f"checkpoint-{step}"
    record_save_begun(ctx.rd.path, step, ctx.attempt)
    ctx.heartbeat("saving", step)
    yield path
    t0 = time.time()
    part = manifest_part(path, ctx.rank, ctx.world_size, checksum=spec.resilience.checksum)
    parts = _gather(part, ctx.world_size)
    if ctx.rank == 0:
        write_commit(
            path,
            parts,
            step=step,
            world_size=ctx.world_size,
            stage=None,
            recipe_hash=spec.recipe_hash,
            kind="state",
            extra={"attempt": ctx.attempt, "fingerprint": spec.fingerprint},
        )
        removed = rotate(ctx.rd.path, spec.save_total_limit, note=lambda line: print(f"ftkit: {line}", flush=True))
        append_jsonl(
            ctx.rd.metrics,
            {
                "event": "commit",
                "step": step,
                "commit_s": round(time.time() - t0, 3),
                "attempt": ctx.attempt,
                "rotated": [str(p) for p in removed],
                "stop": r.stop.stopped_at == step or None,
                "time": time.time(),
            },
        )
    _barrier()
    ctx.heartbeat("train", step, committed=step)
    if r.stop.stopped_at == step:
        ctx.heartbeat("stopped", step, committed=step)
        r.stop.finished.set()


@contextlib.contextmanager
def final(step: int) -> Iterator[Path]:
    """``with ftkit.hf.final(step) as path: accelerator.save_model(model, path)`` on every rank once the loop is
    done: the run's final model, committed (how the supervisor knows the run finished)."""
    r = _state()
    r.ctx.heartbeat("saving", step)
    yield r.ctx.rd.final
    _barrier()
    commit_final(step)


def _fault(r: _Rank) -> Fault:
    if r.fault is None:
        r.fault = Fault(os.environ.get(FAULT_ENV), r.ctx)
    return r.fault


def _gather(part: dict[str, FileEntry], world_size: int) -> list[dict[str, FileEntry]]:
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized():
        parts = cast("list[dict[str, FileEntry]]", [None] * world_size)  # all_gather_object fills it
        dist.all_gather_object(parts, part)  # every rank has finished writing: this is the barrier
        return parts
    return [part]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def stopped_at() -> int | None:
    """The step a graceful stop saved (None: no stop happened)."""
    return _rank.stop.stopped_at if _rank is not None else None


def save_final(trainer: Trainer, output_dir: str | None = None) -> str:
    """Save the trained model as the run's final model (``RUN/final``) with its commit record, on every rank (ZeRO-3
    gathers the weights): how the supervisor knows the run finished. ``output_dir`` (not the run directory): saved
    there as well. Returns the final directory. (Under the import hook, the script's own ``save_model`` does this.)"""
    return save_trained(trainer, output_dir)


def save_trained(
    trainer: Trainer, output_dir: str | None = None, save: Callable[[Trainer, str], None] | None = None
) -> str:
    """Save the trained model as the run's final model (``RUN/final``) and commit it (rank 0), like the built-in
    entry: the supervisor takes a committed ``final/`` of this attempt for "finished". ``output_dir`` other than
    the run directory: saved there too, as the script asked. Returns the final directory. Every rank calls it
    (ZeRO-3 gathers the 16-bit weights)."""
    from pathlib import Path

    if save is None:
        save = type(trainer).save_model
        save = getattr(save, "__wrapped__", save) if getattr(save, "_ftkit", False) else save  # not the hook again
    ctx = context()
    final = ctx.rd.final
    asked = Path(output_dir or cast(str, trainer.args.output_dir)).resolve()  # set by __post_init__
    if asked != ctx.rd.path.resolve() and asked != final.resolve():
        save(trainer, str(asked))
    elif asked != final.resolve():
        print(f"ftkit: save_model({str(asked)!r}) -> {str(final)!r} (the run's final model)", flush=True)
    ctx.heartbeat("saving", trainer.state.global_step)
    save_model(trainer, str(final), save)
    commit_final(trainer.state.global_step, weights=True)
    return str(final)


def save_model(trainer: Trainer, output_dir: str, save: Callable[[Trainer, str], None] | None = None) -> None:
    """``trainer.save_model(output_dir)`` (or SAVE), except under FSDP with a sharded state dict, where HF's
    save_model writes no weights at all (they live only in checkpoints' DCP shards): the full state dict is gathered
    (every rank takes part) and the main process writes it as ``from_pretrained`` loads it (LoRA: the adapter)."""
    plugin = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(plugin, "fsdp_plugin", None)
    if getattr(trainer, "is_fsdp_enabled", False) and plugin is not None:
        if "FULL_STATE_DICT" not in str(plugin.state_dict_type):
            state = trainer.accelerator.get_state_dict(trainer.model)
            if trainer.args.should_save:
                trainer._save(output_dir, state_dict=state)
            trainer.accelerator.wait_for_everyone()
            return
    (save or type(trainer).save_model)(trainer, output_dir)


def commit_final(step: int, weights: bool = False) -> None:
    """After every rank saved ``RUN/final`` (``save_model``): rank 0 writes its commit record, the sign the run
    finished; every rank says so in its heartbeat. ``weights``: the final came from a Trainer's save, so it must
    hold weight files (HF's save_model under FSDP's sharded state dict, for one, writes none); a loop's own
    ``final()`` commits whatever the script wrote."""

    r = _state()
    ctx, spec = r.ctx, r.spec
    if ctx.rank == 0:
        final = ctx.rd.final
        if weights and not model_weights(final):
            e = SaveWroteNothing(
                f"rank 0: the final save wrote no model weights in {final} (does the script's Trainer override "
                "save_model?): a final model without weights is never committed"
            )
            ctx.record_error(e, step=step, repeats=True)
            print(f"ftkit: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(ExitCode.SCRIPT_FAILED)
        write_commit(
            final,
            [manifest_part(final, 0, 1, checksum=spec.resilience.checksum)],
            step=step,
            world_size=ctx.world_size,
            stage=spec.stage,
            kind="model",
            recipe_hash=spec.recipe_hash,
            extra={"final": True, "attempt": ctx.attempt, "fingerprint": spec.fingerprint},
        )
    r.final_step = step
    ctx.heartbeat("finished", step)


def _watch_supervisor(r: _Rank) -> dict[str, float] | None:
    """Stop by itself when ftkit launch is gone (launch/watchdog.py): save first (the same graceful stop the
    supervisor would ask for), bounded by resilience.stop_timeout_s, then end the rank. Returns the watchdog's
    bounds for the pid record (a relaunch waits that long for ranks that stop themselves), None when unwatched."""

    timeout = r.spec.resilience.orphan_timeout_s
    grace = r.spec.resilience.stop_timeout_s
    dog = SupervisorWatchdog(
        r.ctx.rd,
        timeout,
        request_stop=r.stop.local.set,
        stopped=r.stop.finished,
        grace_s=grace,
        on_stop=lambda why: _record_orphan_outcome(r, "orphan_stopped", why),
    )
    if not dog.start():
        print("ftkit: no supervisor owns this run directory: not watching for one", flush=True)
        return None
    r.dog = dog
    return {"orphan_timeout_s": timeout, "stop_timeout_s": grace}


def _record_orphan_outcome(r: _Rank, event: str, why: str) -> None:
    """Rank 0 of a run whose supervisor is gone writes how the run ended into events.jsonl (nobody else will)."""
    if r.ctx.rank != 0 or r.outcome_recorded:
        return
    r.outcome_recorded = True
    if r.final_step is not None:
        what = f"final/ committed at step {r.final_step}"
    elif r.stop.stopped_at is not None:
        what = f"saved and committed step {r.stop.stopped_at} first; ftkit launch resumes from it"
    else:
        what = "nothing new was saved"
    message = f"the ranks ended without their supervisor ({why}): {what}"
    try:
        append_jsonl(
            r.ctx.rd.events,
            {"time": round(time.time(), 3), "event": event, "attempt": r.ctx.attempt, "message": message},
        )
    except OSError:
        pass


def _at_exit(r: _Rank) -> None:
    """A rank that ends on its own while its supervisor is gone (orphaned ranks finishing the run) cleans up what
    the supervisor's teardown would have: the node's /dev/shm buffers and, the run finished, its local checkpoint
    tier; rank 0 records the outcome."""
    dog = r.dog
    try:
        if dog is None or not dog.gone_now():
            return
    except Exception:  # noqa: BLE001 - never turn a clean exit into a failure
        return

    remove_own_shm()
    if r.tier is not None and r.final_step is not None:
        r.tier.end_orphaned(r.ctx, r.spec)  # the run is finished: its local tier is not needed any more
    _record_orphan_outcome(r, "orphan_finished" if r.final_step is not None else "orphan_stopped", "supervisor gone")


def report(e: FtkitError) -> int:
    """An error a restart cannot fix: a record for the supervisor (best effort: the disk may be full) and one line."""
    if _rank is not None:
        try:
            _rank.ctx.record_error(e)
        except OSError:
            pass  # the supervisor still sees the exit, and checks the free space itself
    for line in e.lines():
        print(f"ftkit: error: {line}", file=sys.stderr, flush=True)
    return e.exit_code if e.exit_code else ExitCode.USAGE
