"""The built-in per-rank entry: causal-LM SFT on a local jsonl, an HF Trainer built from the run spec.

Every engine starts this same module on every rank (``python -m ftkit.launch.train RUN_DIR``): the deepspeed
launcher (``--module --no_local_rank``), ``accelerate launch -m`` and ``torchrun -m``. It reads the rank from the
environment those engines set (RANK, LOCAL_RANK, WORLD_SIZE), and everything else from ``RUN_DIR/ftkit/spec.json``
(:class:`ftkit.rundir.spec.RunSpec`) written by ``ftkit launch`` from the same plan as the DeepSpeed config.

It is one client of :mod:`ftkit.hf`, like any wrapped script: commit records, heartbeats, metrics, pid records,
graceful stop and resume all come from there. What it adds: the model, tokenizer and data of the recipe (with an
optional eval split), the final model with its own commit record, and user errors (bad data, bad model directory)
that end the rank with one line, exit code 2 and an error record the supervisor reads: a restart would not fix them.

This is the only module (with ``fixtures``) that imports torch, transformers, peft and deepspeed.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit.errors import ModelConfigError, NoSpace, Problem, UserError
from ftkit.launch import services as hf
from ftkit.launch.data import collate, prepare
from ftkit.launch.parallel import parallelism_args, sp_degree
from ftkit.launch.services import RankContext
from ftkit.rundir.failures import full_path
from ftkit.rundir.layout import atomic_write
from ftkit.rundir.spec import RunSpec

if TYPE_CHECKING:
    import torch
    from transformers import Trainer, TrainingArguments

PROBE_TOKENS = 16  # logits of the first tokens of the first example, saved after training to check the final model


def _load_model(spec: RunSpec, targs: TrainingArguments):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec.precision]
    path = spec.model_path
    revision = spec.model_revision  # set for a hub id: from_pretrained resolves it through the hub cache
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
    if spec.peft:
        from peft import LoraConfig, get_peft_model

        p = spec.peft
        cfg = LoraConfig(
            r=p["r"],
            lora_alpha=p["alpha"],  # type: ignore[arg-type]  # peft annotates an int; any number works (alpha / r)
            lora_dropout=p["dropout"],
            target_modules=p["target_modules"],
            task_type="CAUSAL_LM",
        )
        try:
            # peft's PeftModel wraps the transformers model (another class, the same interface for the Trainer)
            model = get_peft_model(model, cfg)  # type: ignore[assignment]
        except ValueError as e:  # e.g. a target module the model does not have
            raise ModelConfigError(Problem(f"peft.target_modules: {e}".splitlines()[0], file=path)) from None
        if targs.gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def _probe(trainer: Trainer, example: dict[str, list[int]], ctx: RankContext) -> None:
    """Logits of the trained model on a fixed input, every rank taking part (ZeRO-3 gathers in forward)."""
    import torch

    ids = torch.tensor([example["input_ids"][:PROBE_TOKENS]], device=trainer.args.device)
    model = trainer.model_wrapped
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().cpu()
    if ctx.rank == 0:
        atomic_write(ctx.rd.meta / "probe.json", json.dumps({"input_ids": ids.tolist(), "logits": logits.tolist()}))


def _collator(spec: RunSpec, pad_id: int) -> functools.partial[dict[str, torch.Tensor]]:
    """The batches: padded to their longest row; under sequence parallelism to a multiple of sp, with positions,
    and on gloo (CPU ranks) to ``data.max_seq_len``: Ulysses gathers the SP ranks' batches, and gloo's all-gather
    takes only tensors of one shape (NCCL's takes each rank's own width)."""
    sp = sp_degree(spec)
    width = None
    if sp > 1:
        import torch.distributed as dist

        width = spec.data.max_seq_len if dist.is_initialized() and dist.get_backend() == "gloo" else None
    return functools.partial(collate, pad_id=pad_id, sp=sp, width=width)


def train(ctx: RankContext, resume: str | None) -> int | None:
    """Train; return the step a graceful stop saved (None: trained to the end and saved the final model)."""
    spec = hf.spec()
    ctx.heartbeat("loading")
    from transformers import AutoTokenizer, Trainer, TrainingArguments, set_seed

    set_seed(spec.training_args["seed"])
    # before the model: enables ZeRO-3 partitioned loading (the rank's start-up hands DeepSpeed the process group)
    targs = TrainingArguments(**spec.training_args, **parallelism_args(spec))  # type: ignore[arg-type]
    tok_path = spec.tokenizer_path
    try:
        tok_rev = spec.tokenizer_revision
        tokenizer = AutoTokenizer.from_pretrained(tok_path, **({"revision": tok_rev} if tok_rev else {}))
    except (OSError, ValueError) as e:
        raise ModelConfigError(Problem(f"cannot load a tokenizer: {str(e).splitlines()[0]}", file=tok_path)) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = spec.data
    on_too_long = "truncate" if data.truncate else "error"
    rows = prepare(data.train, tokenizer, data.max_seq_len, on_too_long=on_too_long)
    eval_rows = prepare(data.eval, tokenizer, data.max_seq_len, on_too_long=on_too_long) if data.eval else None
    model = _load_model(spec, targs)
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=rows,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        data_collator=_collator(spec, tokenizer.pad_token_id),
        callbacks=hf.callbacks(exit_after_stop=False),
    )
    ctx.heartbeat("train", None)
    trainer.train(resume_from_checkpoint=resume)
    if hf.stopped_at() is not None:
        return hf.stopped_at()  # a graceful stop: the step is committed; no final model from half a run
    ctx.heartbeat("saving", trainer.state.global_step)
    final = ctx.rd.final
    hf.save_model(trainer, str(final))  # stage 3 and FSDP2: gathers the weights; LoRA: the adapter only
    _probe(trainer, rows[0], ctx)
    if ctx.rank == 0:
        tokenizer.save_pretrained(str(final))
    hf.commit_final(trainer.state.global_step, weights=True)
    return None


def _exit_on_sigterm(signum: int, frame: types.FrameType | None) -> None:  # noqa: ARG001
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
    try:
        ctx = hf.start(Path(args.run_dir), args.attempt, args.resume, log_to_console=args.log_to_console)
    except UserError as e:  # a damaged or foreign spec.json
        return hf.report(e)
    try:
        train(ctx, hf.resume_checkpoint())  # the path on this node (a local tier names {host})
    except UserError as e:
        return hf.report(e)
    except Exception as e:  # noqa: BLE001 - only a full disk is turned into a record; the rest re-raises
        # ENOSPC however the library reports it (torch.save's "unexpected pos" on a full tmpfs), in the run directory
        # or this node's local checkpoint tier: exit 12 naming the path, as a restart would fill it again
        full = full_path(str(e), getattr(e, "errno", None), hf.write_paths())
        if full is None:
            raise
        import traceback

        traceback.print_exc()
        return hf.report(NoSpace(f"no space left on {full}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
