"""ftkit's per-rank services for any HF Trainer script: the public face is ``ftkit.hf`` (DESIGN §8).

Under ``ftkit launch`` every rank finds its run in the environment: ``FTKIT_RUN_DIR`` (the run directory),
``FTKIT_ATTEMPT`` and ``FTKIT_RESUME`` (the checkpoint ftkit chose, verified; empty for a fresh start). A script
that wants to be explicit (``ftkit launch --no-inject``) uses::

    import ftkit.hf
    args = ftkit.hf.training_arguments(my_option=...)       # the recipe's values, plus yours where it is silent
    trainer = Trainer(model, args, train_dataset=..., callbacks=ftkit.hf.callbacks())
    trainer.train(resume_from_checkpoint=ftkit.hf.resume_checkpoint())

An unmodified script gets the same through the import hook (:mod:`ftkit.inject`), and the built-in entry
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

import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .errors import ExitCode, FtkitError
from .rundir import RunDir, append_jsonl, atomic_write
from .runspec import RunSpec

RUN_DIR_ENV = "FTKIT_RUN_DIR"
ATTEMPT_ENV = "FTKIT_ATTEMPT"
RESUME_ENV = "FTKIT_RESUME"
FAULT_ENV = "FTKIT_FAULT_INJECT"  # test-only fault injection, see Fault
STOP_FILE = "stop.json"  # in RUN/ftkit/: the supervisor's save-and-stop request
COMPUTE_EWMA = 0.2  # weight of the newest step in the per-rank compute-time average


def _env_int(*names: str, default: int = 0) -> int:
    for n in names:
        if os.environ.get(n, "") != "":
            return int(os.environ[n])
    return default


# ------------------------------------------------------------------------------------------------ the rank


class RankContext:
    """Who this rank is and where its run lives; writes its heartbeat, pid and error records."""

    def __init__(self, run_dir: Path, attempt: int, spec: RunSpec | None = None):
        self.rd = RunDir(run_dir)
        self.attempt = attempt
        self.rank = _env_int("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
        self.local_rank = _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
        self.world_size = _env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", default=1)
        self.host = socket.gethostname()
        # The node's name as the hostfile (and so ssh) knows it: teardown reaches this rank through that name.
        # ftkit sets FTKIT_NODE per node for torchrun/accelerate (c10d numbers nodes by arrival, not hostfile
        # order); DeepSpeed's launcher passes the hostfile index as CROSS_RANK.
        self.node_rank = _env_int("CROSS_RANK", "GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
        self.node_host = os.environ.get("FTKIT_NODE", "")
        if not self.node_host:
            self.node_host = "localhost"
            hosts = spec.hosts if spec is not None else []
            if 0 <= self.node_rank < len(hosts):
                self.node_host = hosts[self.node_rank][0]
        self.last_loss: float | None = None
        self.compute_ewma_s: float | None = None
        self.compute_n = 0

    def heartbeat(self, phase: str, step: int | None = None, **extra: Any) -> None:
        rec = {
            "rank": self.rank,
            "attempt": self.attempt,
            "phase": phase,
            "step": step,
            "loss": self.last_loss,
            "time": time.time(),
            "pid": os.getpid(),
            "host": self.host,
            "node": self.node_host,
            "compute_ewma_s": self.compute_ewma_s,
            "compute_n": self.compute_n,
            **extra,
        }
        atomic_write(self.rd.heartbeat(self.rank), json.dumps(rec), fsync=False)

    def record_pid(self) -> None:
        """pid, start time, parent (the per-node agent) and the node's hostfile name: teardown works from this.
        The allow-listed environment (secrets left out) shows what really reached this rank."""
        import fnmatch

        from .command import ENV_ALLOW, SECRET
        from .procs import proc_start_time

        pid, ppid = os.getpid(), os.getppid()
        env = {
            k: v
            for k, v in sorted(os.environ.items())
            if any(fnmatch.fnmatchcase(k, pat) for pat in ENV_ALLOW) and not SECRET.search(k) and k != "PATH"
        }
        rec = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node_rank": self.node_rank,
            "host": self.node_host,
            "hostname": self.host,
            "pid": pid,
            "start_time": proc_start_time(pid),
            "ppid": ppid,
            "ppid_start_time": proc_start_time(ppid),
            "pgid": os.getpgid(0),
            "attempt": self.attempt,
            "time": time.time(),
            "env": env,
            "env_keys": sorted(os.environ),
            # DeepSpeed's CPU collectives name their /dev/shm buffers after these; teardown removes them.
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": os.environ.get("MASTER_PORT"),
        }
        atomic_write(self.rd.pid_file(self.attempt, self.rank), json.dumps(rec), fsync=False)

    def record_error(self, err: FtkitError, **extra: Any) -> None:
        rec = {
            "rank": self.rank,
            "host": self.host,
            "kind": type(err).__name__,
            "lines": err.lines(),
            "exit_code": err.exit_code,
            **extra,
        }
        atomic_write(self.rd.error_file(self.attempt, self.rank), json.dumps(rec))


class _Rank:
    """The per-process state behind the module functions (one run per process)."""

    def __init__(self, run_dir: Path, attempt: int, resume: str | None):
        self.spec = RunSpec.read(RunDir(run_dir).spec)
        self.ctx = RankContext(run_dir, attempt, self.spec)
        self.resume = resume or None
        self.stop = StopRequest(self.ctx.rd, attempt)
        self.changes_recorded = False


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
        if "tensorboard" in (r.spec.training_args.get("report_to") or []):
            # transformers 5.x has no logging_dir: its TensorBoard callback reads this variable (run directory only)
            from .spec import tensorboard_dir

            os.environ.setdefault("TENSORBOARD_LOGGING_DIR", tensorboard_dir(r.spec.training_args["output_dir"]))
        if not log_to_console:
            _redirect_output(r.ctx.rd.rank_log(attempt, r.ctx.rank))
        r.ctx.record_pid()
        r.ctx.heartbeat("starting")
        _watch_supervisor(r)
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


def resume_checkpoint() -> str | None:
    """The checkpoint ftkit chose and verified for this attempt (None: a fresh start). Pass it to
    ``trainer.train(resume_from_checkpoint=...)``."""
    return _state().resume


def recipe_arguments() -> dict[str, Any]:
    """The TrainingArguments values the recipe states (the source of truth for them); everything else stays the
    script's. The built-in entry uses all of ``spec.training_args``."""
    s = _state().spec
    return {k: s.training_args[k] for k in s.stated_args if k in s.training_args}


def training_arguments(cls: Any = None, **overrides: Any) -> Any:
    """``TrainingArguments`` (or ``cls``, e.g. TRL's ``SFTConfig``) with the recipe's values; ``overrides`` fill in
    what the recipe does not state. An override of a value the recipe states loses, and is listed."""
    if cls is None:
        from transformers import TrainingArguments as cls  # noqa: N813
    stated = recipe_arguments()
    kwargs = {**overrides, **stated}
    changes = [(k, overrides[k], stated[k]) for k in overrides if k in stated and overrides[k] != stated[k]]
    record_changes(changes)
    return cls(**kwargs)


def apply(args: Any) -> tuple[Any, list[tuple[str, Any, Any]]]:
    """A copy of ``args`` (TrainingArguments or a subclass) with the recipe's values, and ``(name, old, new)`` for
    each value that changed. ``dataclasses.replace`` runs ``__post_init__`` again, so derived state (the DeepSpeed
    config object, the device) follows the new values."""
    stated = recipe_arguments()
    fields = {f.name for f in dataclasses.fields(args) if f.init}
    new = {k: v for k, v in stated.items() if k in fields}
    changes = [(k, getattr(args, k, None), v) for k, v in new.items() if _differs(getattr(args, k, None), v)]
    if not changes:
        return args, []
    return dataclasses.replace(args, **{k: v for k, _, v in changes}), changes


def _differs(old: Any, new: Any) -> bool:
    old = getattr(old, "value", old)  # enums (save_strategy, lr_scheduler_type) compare by value
    return old != new


def record_changes(changes: list[tuple[str, Any, Any]]) -> None:
    """Rank 0 writes the TrainingArguments values ftkit changed to ``ftkit/attempts/N/args_changes.json``; the
    supervisor lists each once (``name: from -> to``) and puts them in events.jsonl."""
    r = _state()
    if r.ctx.rank != 0 or not changes:
        return
    path = r.ctx.rd.attempt_dir(r.ctx.attempt) / "args_changes.json"
    old: list[dict[str, Any]] = []
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    seen = {c["name"] for c in old}
    rows = old + [{"name": n, "from": _jsonable(a), "to": _jsonable(b)} for n, a, b in changes if n not in seen]
    atomic_write(path, json.dumps(rows, indent=1, default=str))


def _jsonable(v: Any) -> Any:
    v = getattr(v, "value", v)
    return v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)


def callbacks(*, exit_after_stop: bool = True) -> list[Any]:
    """The HF ``TrainerCallback`` that carries every per-rank service. ``exit_after_stop``: after a graceful stop
    end the process (exit 0) when ``trainer.train()`` returns, so a script does not go on to save a "final" model
    from a run stopped half-way; the built-in entry handles the stop itself."""
    r = _state()
    fault = Fault(os.environ.get(FAULT_ENV), r.ctx)
    fault.install_save_kill()
    return [_callback_class()(r, fault, exit_after_stop=exit_after_stop)]


def stopped_at() -> int | None:
    """The step a graceful stop saved (None: no stop happened)."""
    return _rank.stop.stopped_at if _rank is not None else None


def save_final(trainer: Any, output_dir: str | None = None) -> str:
    """Save the trained model as the run's final model (``RUN/final``) with its commit record, on every rank (ZeRO-3
    gathers the weights): how the supervisor knows the run finished. ``output_dir`` (not the run directory): saved
    there as well. Returns the final directory. (Under the import hook, the script's own ``save_model`` does this.)"""
    from .inject import save_final as _save_final

    return _save_final(trainer, output_dir)


def commit_final(step: int) -> None:
    """After every rank saved ``RUN/final`` (``save_model``): rank 0 writes its commit record, the sign the run
    finished; every rank says so in its heartbeat."""
    from .checkpoints import manifest_part, write_commit

    r = _state()
    ctx, spec = r.ctx, r.spec
    if ctx.rank == 0:
        final = ctx.rd.final
        write_commit(
            final,
            [manifest_part(final, 0, 1, checksum=spec.checksum)],
            step=step,
            world_size=ctx.world_size,
            stage=spec.stage,
            kind="model",
            recipe_hash=spec.recipe_hash,
            extra={"final": True, "attempt": ctx.attempt, "fingerprint": spec.fingerprint},
        )
    ctx.heartbeat("finished", step)


# ------------------------------------------------------------------------------------------------ graceful stop


class StopRequest:
    """Save-and-stop: requested by the supervisor (``ftkit/stop.json`` of this attempt) or by this rank's watchdog
    (its supervisor is gone). :meth:`agreed` is called by every rank at every optimizer-step end and all-reduces the
    local answer (max), so every rank sees the request at the same step, or none does."""

    def __init__(self, rd: RunDir, attempt: int):
        self.path = rd.meta / STOP_FILE
        self.attempt = attempt
        self.local = threading.Event()
        self.stopped_at: int | None = None
        self.finished = threading.Event()

    def requested_here(self) -> bool:
        if self.local.is_set():
            return True
        if not self.path.exists():  # one stat per step in the common case
            return False
        try:
            rec = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(rec, dict) and rec.get("attempt") == self.attempt

    def agreed(self, device: Any = None) -> bool:
        flag = 1 if self.requested_here() else 0
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            t = torch.tensor([flag], dtype=torch.int32, device=device if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        return bool(flag)


# ------------------------------------------------------------------------------------------------ the callback


_CALLBACK: Any = None


def _callback_class() -> Any:
    global _CALLBACK
    if _CALLBACK is not None:
        return _CALLBACK
    from transformers import TrainerCallback

    from .checkpoints import manifest_part, rotate, write_commit

    class FtkitCallback(TrainerCallback):
        """Heartbeat, metrics, commit records, graceful stop and resume overrides, on HF Trainer's own events."""

        def __init__(self, r: _Rank, fault: Fault, exit_after_stop: bool = True):
            self.r, self.ctx, self.spec, self.fault = r, r.ctx, r.spec, fault
            self.exit_after_stop = exit_after_stop
            self._t0: float | None = None
            self._compute = 0.0
            self._hooked = False

        # ------------------------------------------------------------------ lifecycle

        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001
            overrides = self.spec.resume_overrides
            if self.r.resume and overrides:  # after the checkpoint's optimizer and scheduler state were loaded
                for line in apply_resume_overrides(overrides, kw.get("optimizer"), kw.get("lr_scheduler")):
                    print(f"ftkit: resume override {line}", flush=True)
            self._hook_forward(kw.get("model"))
            self.ctx.heartbeat("train", state.global_step, started_at_step=state.global_step)
            # DeepSpeed has built its ops by now: back to dying at once on SIGTERM, so a rank blocked in a
            # collective (a dead peer) does not hold teardown for its whole grace period.
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            self._compute = 0.0

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            if self._hooked and self._compute > 0:
                c = self._compute
                e = self.ctx.compute_ewma_s
                self.ctx.compute_ewma_s = c if e is None else (1 - COMPUTE_EWMA) * e + COMPUTE_EWMA * c
                self.ctx.compute_n += 1
            self.ctx.heartbeat("train", state.global_step)
            self.fault.after_step(state.global_step)
            if self.r.stop.stopped_at is None and self.r.stop.agreed(getattr(args, "device", None)):
                self.r.stop.stopped_at = state.global_step
                control.should_save = True  # this step, on every rank: then the loop ends
                control.should_training_stop = True
                print(f"ftkit: stop requested: saving step {state.global_step}, then stopping", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            logs = logs or {}
            rec: dict[str, Any] | None = None
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
            if rec is not None and self.ctx.rank == 0:
                append_jsonl(self.ctx.rd.metrics, {**rec, "attempt": self.ctx.attempt, "time": time.time()})
            self.ctx.heartbeat("train", state.global_step)

        def on_save(self, args, state, control, **kw):  # noqa: ANN001
            import torch.distributed as dist

            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            t0 = time.time()
            part = manifest_part(ckpt, self.ctx.rank, self.ctx.world_size, checksum=self.spec.checksum)
            parts: list[Any] = [None] * self.ctx.world_size
            if dist.is_available() and dist.is_initialized():
                dist.all_gather_object(parts, part)  # every rank has finished writing: this is the barrier
            else:
                parts = [part]
            if self.ctx.rank == 0:
                write_commit(
                    ckpt,
                    parts,
                    step=state.global_step,
                    world_size=self.ctx.world_size,
                    stage=self.spec.stage,
                    recipe_hash=self.spec.recipe_hash,
                    extra={"attempt": self.ctx.attempt, "fingerprint": self.spec.fingerprint},
                )
                removed = rotate(args.output_dir, self.spec.save_total_limit)
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

        def on_train_end(self, args, state, control, **kw):  # noqa: ANN001
            if self.r.stop.stopped_at is None:
                return
            self.ctx.heartbeat("stopped", state.global_step, committed=self.r.stop.stopped_at)
            self.r.stop.finished.set()
            print(f"ftkit: stopped on request after committing step {self.r.stop.stopped_at}", flush=True)
            if self.exit_after_stop:
                sys.stdout.flush()
                raise SystemExit(0)

        # ------------------------------------------------------------------ compute time (stragglers)

        def _hook_forward(self, model: Any) -> None:
            """Time the model's forward passes on this rank's own clock. Under DDP and ZeRO-1/2 a forward holds no
            collective, so a slow host shows up here and not in the (lock-step) step time; under ZeRO-3 the
            forward also waits for parameter gathers."""
            if model is None or self._hooked:
                return

            def pre(module: Any, inputs: Any) -> None:
                self._t0 = time.perf_counter()

            def post(module: Any, inputs: Any, output: Any) -> None:
                if self._t0 is not None:
                    self._compute += time.perf_counter() - self._t0
                    self._t0 = None

            model.register_forward_pre_hook(pre)
            model.register_forward_hook(post)
            self._hooked = True

    _CALLBACK = FtkitCallback
    return _CALLBACK


# ------------------------------------------------------------------------------------------------ resume overrides


def _lr_scheduler_of(lr_scheduler: Any) -> Any:
    """The torch LR scheduler inside Accelerate's/DeepSpeed's wrappers (the object with ``base_lrs``)."""
    seen = 0
    while lr_scheduler is not None and not hasattr(lr_scheduler, "base_lrs") and seen < 4:
        lr_scheduler = getattr(lr_scheduler, "scheduler", None) or getattr(lr_scheduler, "lr_scheduler", None)
        seen += 1
    return lr_scheduler if hasattr(lr_scheduler, "base_lrs") else None


def apply_resume_overrides(overrides: dict[str, Any], optimizer: Any, lr_scheduler: Any) -> list[str]:
    """Apply allowed changes of optimizer hyperparameters to a resumed run; return one line per change.

    Called after the checkpoint is loaded (HF Trainer's ``on_train_begin`` follows DeepSpeed's ``load_checkpoint``
    and ``_load_optimizer_and_scheduler`` in ``_inner_training_loop``): loading restores the *old* values into the
    optimizer's param groups (``lr``, ``initial_lr``, ``betas``, ``eps``, ``weight_decay``) and the scheduler's
    ``base_lrs``, so the new TrainingArguments alone are ignored. The schedule's shape (type, warm-up, horizon) is
    rebuilt from the current arguments by HF (LambdaLR keeps its lambdas, restores only its step and base lrs), so
    a new peak lr is applied by replacing ``base_lrs`` and recomputing the current lr at the restored step.
    Keys this function does not know took effect through the new spec (TrainingArguments, ds_config.json).
    """
    from .fingerprint import RANK_APPLIED

    sched = _lr_scheduler_of(lr_scheduler)
    groups = sched.optimizer.param_groups if sched is not None else optimizer.param_groups
    lines: list[str] = []
    if "train.learning_rate" in overrides:
        new = float(overrides["train.learning_rate"])
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
        new = float(overrides["train.weight_decay"])
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
        new = float(overrides["train.adam_epsilon"])
        old_eps = groups[0].get("eps")
        for g in groups:
            g["eps"] = new
        lines.append(f"train.adam_epsilon: {old_eps} -> {new}")
    for key in sorted(set(overrides) - set(RANK_APPLIED)):
        lines.append(f"{key}: {overrides[key]!r} (applied through the new spec)")
    return lines


# ------------------------------------------------------------------------------------------------ process set-up


def _redirect_output(path: Path) -> None:
    """Send this process's stdout/stderr (including C-level writes from torch/deepspeed) to its own log file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _watch_supervisor(r: _Rank) -> None:
    """Stop by itself when ftkit launch is gone (launch/watchdog.py): save first (the same graceful stop the
    supervisor would ask for), bounded by resilience.stop_timeout_s, then end the rank."""
    from .launch.watchdog import SupervisorWatchdog

    timeout = float(r.spec.resilience("orphan_timeout_s", 60.0))
    grace = float(r.spec.resilience("stop_timeout_s", 120.0))
    dog = SupervisorWatchdog(r.ctx.rd, timeout, request_stop=r.stop.local.set, stopped=r.stop.finished, grace_s=grace)
    if not dog.start():
        print("ftkit: no supervisor owns this run directory: not watching for one", flush=True)


class Fault:
    """Test-only fault injection, from ``FTKIT_FAULT_INJECT=ACTION:RANK:STEP[:ATTEMPT]`` (ATTEMPT: a number or
    ``every``; default 0, so a restarted attempt runs clean).

    ACTION is ``exit`` (exit 13 after that step), ``kill`` (SIGKILL itself after that step), ``stop`` (SIGSTOP
    itself: a hang), ``raise`` (an exception after that step) or ``kill_in_save`` (SIGKILL itself in the middle of
    saving checkpoint STEP, after DeepSpeed wrote its shards and before the RNG state and trainer_state.json: a torn
    checkpoint). The processes are real and really die; only the moment is chosen, so tests are not races against a
    millisecond-long save. Works for the built-in entry and any wrapped script (it rides on ftkit.hf.callbacks).
    """

    def __init__(self, spec: str | None, ctx: RankContext):
        self.action = None
        if not spec:
            return
        parts = spec.split(":")
        action, rank, step = parts[0], int(parts[1]), int(parts[2])
        attempt = parts[3] if len(parts) > 3 else "0"
        if rank == ctx.rank and (attempt == "every" or int(attempt) == ctx.attempt):
            self.action, self.step = action, step

    def after_step(self, step: int) -> None:
        if self.action is None or step != self.step:
            return
        print(f"ftkit fault injection: {self.action} at step {step}", flush=True)
        if self.action == "exit":
            os._exit(13)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.action == "raise":
            raise RuntimeError(f"fault injection: an exception at step {step}")

    def install_save_kill(self) -> None:
        if self.action != "kill_in_save":
            return
        from transformers import Trainer

        if getattr(Trainer._save_rng_state, "_ftkit_fault", False):
            return
        original = Trainer._save_rng_state
        fault = self

        def _save_rng_state(trainer: Any, output_dir: str) -> None:
            if trainer.state.global_step == fault.step:
                print(f"ftkit fault injection: SIGKILL while saving {output_dir}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(trainer, output_dir)

        _save_rng_state._ftkit_fault = True  # type: ignore[attr-defined]
        Trainer._save_rng_state = _save_rng_state


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
