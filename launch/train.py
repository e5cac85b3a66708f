"""The per-rank training entry: HF Trainer built from the run spec, with commit records and a heartbeat.

Every engine starts this same module on every rank (``python -m ftkit.launch.train RUN_DIR``): the deepspeed
launcher (``--module --no_local_rank``), ``accelerate launch -m`` and ``torchrun -m``. It reads the rank from the
environment those engines set (RANK, LOCAL_RANK, WORLD_SIZE), and everything else from ``RUN_DIR/ftkit/spec.json``
written by ``ftkit launch`` from the same plan as the DeepSpeed config.

What it adds to a plain HF Trainer run:

* **commit records**: after each checkpoint save all ranks gather a manifest of the files they wrote (an
  all-gather is also the barrier), then rank 0 writes ``ftkit_commit.json`` atomically. A checkpoint without one
  is torn and is never resumed from. Rotation (``save_total_limit``) is ftkit's, counting committed ones only.
* **heartbeat**: each rank rewrites ``ftkit/heartbeat/rank-R.json`` every step (step, loss, time), so the
  supervisor can tell progress from a hang; rank 0 appends losses to ``metrics.jsonl``.
* **pid records** for teardown by pid, and one log file per rank per attempt.
* **user errors** (bad data, bad model directory) end the rank with one line, exit code 2 and an error record the
  supervisor reads: a restart would not fix them.

This is the only module (with ``fixtures``) that imports torch, transformers, peft and deepspeed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ftkit.errors import ExitCode, FtkitError, NoSpace, UserError
from ftkit.rundir import NEARLY_FULL, RunDir, append_jsonl, atomic_write

PROBE_TOKENS = 16  # logits of the first tokens of the first example, saved after training to check the final model
FAULT_ENV = "FTKIT_FAULT_INJECT"  # test-only fault injection, see Fault


def _env_int(*names: str, default: int = 0) -> int:
    for n in names:
        if os.environ.get(n, "") != "":
            return int(os.environ[n])
    return default


class RankContext:
    def __init__(self, run_dir: Path, attempt: int):
        self.rd = RunDir(run_dir)
        self.attempt = attempt
        self.rank = _env_int("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
        self.local_rank = _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
        self.world_size = _env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)
        self.host = socket.gethostname()
        # The node's name as the hostfile (and so ssh) knows it: teardown reaches this rank through that name.
        # ftkit sets FTKIT_NODE per node for torchrun/accelerate (c10d numbers nodes by arrival, not hostfile
        # order); DeepSpeed's launcher passes the hostfile index as CROSS_RANK.
        self.node_rank = _env_int("CROSS_RANK", "GROUP_RANK", "NODE_RANK")
        self.node_host = os.environ.get("FTKIT_NODE", "")
        if not self.node_host:
            self.node_host = "localhost"
            try:
                hosts = self.rd.read_spec().get("hosts") or []
                if 0 <= self.node_rank < len(hosts):
                    self.node_host = hosts[self.node_rank][0]
            except (OSError, ValueError):
                pass
        self.last_loss: float | None = None

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
            **extra,
        }
        atomic_write(self.rd.heartbeat(self.rank), json.dumps(rec), fsync=False)

    def record_pid(self) -> None:
        """pid, start time, parent (the per-node agent) and the node's hostfile name: teardown works from this.
        The allow-listed environment (secrets left out) shows what really reached this rank."""
        import fnmatch

        from ftkit.command import ENV_ALLOW, SECRET
        from ftkit.procs import proc_start_time

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

    def record_error(self, err: FtkitError) -> None:
        rec = {
            "rank": self.rank,
            "host": self.host,
            "kind": type(err).__name__,
            "lines": err.lines(),
            "exit_code": err.exit_code,
        }
        atomic_write(self.rd.error_file(self.attempt, self.rank), json.dumps(rec))


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


class Fault:
    """Test-only fault injection, from ``FTKIT_FAULT_INJECT=ACTION:RANK:STEP[:ATTEMPT]`` (ATTEMPT: a number or
    ``every``; default 0, so a restarted attempt runs clean).

    ACTION is ``exit`` (exit 13 after that step), ``kill`` (SIGKILL itself after that step), ``stop`` (SIGSTOP
    itself: a hang) or ``kill_in_save`` (SIGKILL itself in the middle of saving checkpoint STEP, after DeepSpeed
    wrote its shards and before the RNG state and trainer_state.json: a torn checkpoint). The processes are real
    and really die; only the moment is chosen, so tests are not races against a millisecond-long save.
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
        import signal

        print(f"ftkit fault injection: {self.action} at step {step}", flush=True)
        if self.action == "exit":
            os._exit(13)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)

    def install_save_kill(self, trainer_cls: Any) -> None:
        if self.action != "kill_in_save":
            return
        import signal

        original = trainer_cls._save_rng_state
        fault = self

        def _save_rng_state(trainer: Any, output_dir: str) -> None:
            if trainer.state.global_step == fault.step:
                print(f"ftkit fault injection: SIGKILL while saving {output_dir}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(trainer, output_dir)

        trainer_cls._save_rng_state = _save_rng_state


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
    from ftkit.fingerprint import RANK_APPLIED

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


def _make_callback(ctx: RankContext, spec: dict[str, Any], fault: Fault, resume: str | None = None):
    import torch.distributed as dist
    from transformers import TrainerCallback

    from ftkit.checkpoints import manifest_part, rotate, write_commit

    class FtkitCallback(TrainerCallback):
        """Heartbeat, metrics and commit records, hooked into HF Trainer's own events."""

        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001
            overrides = spec.get("resume_overrides") or {}
            if resume and overrides:  # after the checkpoint's optimizer and scheduler state were loaded
                for line in apply_resume_overrides(overrides, kw.get("optimizer"), kw.get("lr_scheduler")):
                    print(f"ftkit: resume override {line}", flush=True)
            ctx.heartbeat("train", state.global_step, started_at_step=state.global_step)
            # DeepSpeed has built its ops by now: back to dying at once on SIGTERM, so a rank blocked in a
            # collective (a dead peer) does not hold teardown for its whole grace period.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            ctx.heartbeat("train", state.global_step)
            fault.after_step(state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            logs = logs or {}
            if "loss" in logs:
                ctx.last_loss = float(logs["loss"])
                if ctx.rank == 0:
                    append_jsonl(
                        ctx.rd.metrics,
                        {
                            "step": state.global_step,
                            "loss": ctx.last_loss,
                            "lr": logs.get("learning_rate"),
                            "grad_norm": logs.get("grad_norm"),
                            "attempt": ctx.attempt,
                            "time": time.time(),
                        },
                    )
            ctx.heartbeat("train", state.global_step)

        def on_save(self, args, state, control, **kw):  # noqa: ANN001
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            t0 = time.time()
            part = manifest_part(ckpt, ctx.rank, ctx.world_size, checksum=_checksum_mode(spec))
            parts: list[Any] = [None] * ctx.world_size
            if dist.is_available() and dist.is_initialized():
                dist.all_gather_object(parts, part)  # every rank has finished writing: this is the barrier
            else:
                parts = [part]
            if ctx.rank == 0:
                write_commit(
                    ckpt,
                    parts,
                    step=state.global_step,
                    world_size=ctx.world_size,
                    stage=spec["stage"],
                    recipe_hash=spec["recipe_hash"],
                    extra={"attempt": ctx.attempt, "fingerprint": spec.get("fingerprint")},
                )
                removed = rotate(args.output_dir, spec["save_total_limit"])
                append_jsonl(
                    ctx.rd.metrics,
                    {
                        "event": "commit",
                        "step": state.global_step,
                        "commit_s": round(time.time() - t0, 3),
                        "attempt": ctx.attempt,
                        "rotated": [str(p) for p in removed],
                        "time": time.time(),
                    },
                )
            if dist.is_available() and dist.is_initialized():
                dist.barrier()  # nobody trains on (or dies) before the commit is on disk
            ctx.heartbeat("train", state.global_step, committed=state.global_step)

    return FtkitCallback()


def _load_model(spec: dict[str, Any], targs: Any):
    import torch
    from transformers import AutoModelForCausalLM

    from ftkit.errors import ModelConfigError, Problem

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["recipe"]["train"]["precision"], torch.float32)
    path = spec["model_path"]
    revision = spec.get("model_revision")  # set for a hub id: from_pretrained resolves it through the hub cache
    if revision is None and not (Path(path) / "config.json").is_file():
        raise ModelConfigError(Problem("no config.json: not a model directory", file=path))
    hub = {"revision": revision} if revision is not None else {}
    # TrainingArguments(deepspeed=...) was built first: at ZeRO-3 from_pretrained partitions weights as it loads.
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **hub)
    except OSError as e:  # a hub id whose weights are neither cached nor reachable, a private model, ...
        if revision is None:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelConfigError(Problem(f"cannot load {path} (revision {revision}): {first}", file=path)) from None
    if spec["peft"]:
        from peft import LoraConfig, get_peft_model

        p = spec["peft"]
        cfg = LoraConfig(
            r=p["r"],
            lora_alpha=p["alpha"],
            lora_dropout=p["dropout"],
            target_modules=p["target_modules"],
            task_type="CAUSAL_LM",
        )
        try:
            model = get_peft_model(model, cfg)
        except ValueError as e:  # e.g. a target module the model does not have
            raise ModelConfigError(Problem(f"peft.target_modules: {e}".splitlines()[0], file=path)) from None
        if targs.gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def _probe(trainer: Any, example: dict[str, Any], ctx: RankContext) -> None:
    """Logits of the trained model on a fixed input, every rank taking part (ZeRO-3 gathers in forward)."""
    import torch

    ids = torch.tensor([example["input_ids"][:PROBE_TOKENS]], device=trainer.args.device)
    model = trainer.model_wrapped
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().cpu()
    if ctx.rank == 0:
        atomic_write(ctx.rd.meta / "probe.json", json.dumps({"input_ids": ids.tolist(), "logits": logits.tolist()}))


def _share_process_group_with_deepspeed(targs: Any) -> None:
    """On CPU (``use_cpu``) TrainingArguments starts torch.distributed through Accelerate's MULTI_CPU path, which
    leaves ``deepspeed.comm`` uninitialized; ZeRO-3's ``zero.Init`` inside ``from_pretrained`` then reads world
    size 1 and fails DeepSpeed's batch-size check (16 != 4 x 2 x 1). Hand the existing group to DeepSpeed first
    (a no-op on GPU, where Accelerate already went through DeepSpeed)."""
    import torch.distributed as tdist

    if not (targs.deepspeed and tdist.is_available() and tdist.is_initialized()):
        return
    import deepspeed
    from deepspeed import comm

    if not comm.is_initialized():
        deepspeed.init_distributed(dist_backend=targs.ddp_backend or None)


def train(ctx: RankContext, resume: str | None) -> None:
    spec = ctx.rd.read_spec()
    ctx.heartbeat("loading")
    import functools

    from transformers import AutoTokenizer, Trainer, TrainingArguments, set_seed

    from ftkit.checkpoints import manifest_part, write_commit

    from .data import collate, prepare

    set_seed(spec["training_args"]["seed"])
    targs = TrainingArguments(**spec["training_args"])  # before the model: enables ZeRO-3 partitioned loading
    _share_process_group_with_deepspeed(targs)
    tok_path = spec["tokenizer_path"]
    try:
        tok_rev = spec.get("tokenizer_revision")
        tokenizer = AutoTokenizer.from_pretrained(tok_path, **({"revision": tok_rev} if tok_rev else {}))
    except (OSError, ValueError) as e:
        from ftkit.errors import ModelConfigError, Problem

        raise ModelConfigError(Problem(f"cannot load a tokenizer: {str(e).splitlines()[0]}", file=tok_path)) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = spec["data"]
    rows = prepare(
        data["train"], tokenizer, data["max_seq_len"], on_too_long="truncate" if data["truncate"] else "error"
    )
    model = _load_model(spec, targs)
    fault = Fault(os.environ.get(FAULT_ENV), ctx)
    fault.install_save_kill(Trainer)
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=rows,
        processing_class=tokenizer,
        data_collator=functools.partial(collate, pad_id=tokenizer.pad_token_id),
        callbacks=[_make_callback(ctx, spec, fault, resume=resume)],
    )
    ctx.heartbeat("train", None)
    trainer.train(resume_from_checkpoint=resume)
    ctx.heartbeat("saving", trainer.state.global_step)
    final = ctx.rd.final
    trainer.save_model(str(final))  # stage 3: gathers 16-bit weights; LoRA: the adapter only
    _probe(trainer, rows[0], ctx)
    if ctx.rank == 0:
        tokenizer.save_pretrained(str(final))
        part = manifest_part(final, 0, 1, checksum=_checksum_mode(spec))
        write_commit(
            final,
            [part],
            step=trainer.state.global_step,
            world_size=ctx.world_size,
            stage=spec["stage"],
            kind="model",
            recipe_hash=spec["recipe_hash"],
            extra={"final": True, "attempt": ctx.attempt, "fingerprint": spec.get("fingerprint")},
        )
    ctx.heartbeat("finished", trainer.state.global_step)


def _checksum_mode(spec: dict[str, Any]) -> str:
    """resilience.checksum: full (every byte, the default) or sampled (opt-in for very large checkpoints)."""
    return str(spec["recipe"]["resilience"].get("checksum") or "full")


def _watch_supervisor(ctx: RankContext) -> None:
    """Stop by itself when ftkit launch is gone (launch/watchdog.py); resilience.orphan_timeout_s bounds it."""
    from .watchdog import SupervisorWatchdog

    try:
        timeout = float(ctx.rd.read_spec()["recipe"]["resilience"]["orphan_timeout_s"])
    except (OSError, ValueError, KeyError, TypeError):
        timeout = 60.0
    if not SupervisorWatchdog(ctx.rd, timeout).start():
        print("ftkit: no supervisor owns this run directory: not watching for one", flush=True)


def _exit_on_sigterm(signum: int, frame: Any) -> None:  # noqa: ARG001
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftkit.launch.train", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="Run directory written by ftkit launch (holds ftkit/spec.json).")
    ap.add_argument("--attempt", type=int, default=0, help="Attempt number (the supervisor counts restarts).")
    ap.add_argument("--resume", default=None, help="Checkpoint directory to resume from (already verified).")
    ap.add_argument("--log-to-console", action="store_true", help="Keep output on the console, no per-rank log.")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed without --no_local_rank
    args = ap.parse_args(argv)
    # Teardown sends SIGTERM first: unwind like an exception so `finally` blocks run. torch's JIT build of
    # DeepSpeed ops (CPU Adam) holds a lock file it removes only in `finally`; killed by the default action
    # mid-build it leaves the lock behind and every later run waits on it forever.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ctx = RankContext(Path(args.run_dir), args.attempt)
    if not args.log_to_console:
        _redirect_output(ctx.rd.rank_log(args.attempt, ctx.rank))
    ctx.record_pid()
    ctx.heartbeat("starting")
    _watch_supervisor(ctx)
    print(
        f"ftkit rank {ctx.rank}/{ctx.world_size} on {ctx.host} pid {os.getpid()} attempt {args.attempt} "
        f"resume={args.resume}",
        flush=True,
    )
    try:
        train(ctx, args.resume)
    except UserError as e:
        return _report(ctx, e)
    except Exception as e:  # noqa: BLE001 - only a full disk is turned into a record; the rest re-raises
        if not _no_space(e, ctx.rd.path):
            raise
        import traceback

        traceback.print_exc()
        return _report(ctx, NoSpace(f"no space left on {getattr(e, 'filename', None) or ctx.rd.path}"))
    return 0


def _report(ctx: RankContext, e: FtkitError) -> int:
    """An error a restart cannot fix: a record for the supervisor (best effort: the disk may be full) and one line."""
    try:
        ctx.record_error(e)
    except OSError:
        pass  # the supervisor still sees the exit, and checks the free space itself
    for line in e.lines():
        print(f"ftkit: error: {line}", file=sys.stderr, flush=True)
    return e.exit_code if e.exit_code else ExitCode.USAGE


def _no_space(e: BaseException, run_dir: Path) -> bool:
    """ENOSPC however the library reports it: OSError, torch.save's "file write failed", safetensors' StorageFull."""
    import errno
    import shutil

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    if "No space left" in text or "StorageFull" in text:
        return True
    try:
        return "write failed" in text and shutil.disk_usage(run_dir).free < NEARLY_FULL
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
