"""Peak host memory of ``ftkit export`` against DeepSpeed's ``zero_to_fp32``, on a real ZeRO checkpoint of a model
with more than 1 GB of fp32 weights.

Why: ``zero_to_fp32`` (and ``save_pretrained`` after ``load_state_dict``) hold the whole model in host memory, a
ZeRO-1/2 checkpoint even twice (the ranks' partitions concatenated, then viewed per parameter); a 70B model needs
280 GB of RAM to export. ``ftkit export`` copies one tensor at a time out of memory-mapped shards into the output
file, so its peak should be about the largest tensor over the interpreter's baseline, whatever the model size.

What it does, in a temporary directory (``--dir``):

1. builds a llama-style model from a config (random init, nothing downloaded; ``--hidden 1536 --layers 8 --vocab
   32000``: 324M parameters, 1.30 GB in fp32), wraps it with ``deepspeed.initialize`` on one CPU process
   (``DS_ACCELERATOR=cpu``, gloo, ZeRO ``--stage``, torch AdamW) and ``save_checkpoint``s it untrained (Adam's
   moments are created on the first step, so the shards hold exactly the fp32 master weights, plus the module
   states DeepSpeed writes), laid out as HF Trainer's ``checkpoint-1/`` in a run directory with ftkit's
   ``spec.json`` and a commit record (every byte checksummed, as a training run commits it);
2. runs, each in a fresh process that reports its VmHWM (peak resident set, /proc/self/status) and its RSS after
   importing torch and deepspeed (the baseline every contender pays):

   * ``ftkit export RUN --checkpoint 1 --no-verify`` (the export alone: verify the commit, stream, write);
   * ``zero_to_fp32``: DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict`` (safetensors, the same
     ``--max-shard-size``), what users run today;
   * ``ftkit export --verify OUT`` (the logits proof alone: DeepSpeed's consolidation, a model built from the
     config, then the export loaded with ``from_pretrained``; it holds whole models by design);

3. prints a table, and checks that both exports hold the same tensors, bit for bit.

Usage: ``DS_ACCELERATOR=cpu python benchmarks/export_memory.py [--stage 2] [--max-shard-size 5GB] [--dir D]``.
Needs about 3x the model size in free disk and 4x in free memory (for building the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


# ----------------------------------------------------------------------------------------------- children


def build(root: Path, args: argparse.Namespace) -> None:
    """checkpoint-1/ of an untrained model, saved by DeepSpeed, in a run directory ftkit export accepts."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e6:,.0f}M parameters, {n * 4 / 1e9:.2f} GB fp32", flush=True)
    run = root / "run"
    ckpt = run / "checkpoint-1"
    ckpt.mkdir(parents=True)
    config.save_pretrained(ckpt)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
    }
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.save_checkpoint(str(ckpt), tag="global_step1")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    torch.save({"cpu": torch.get_rng_state()}, ckpt / "rng_state.pth")  # as HF Trainer's single-process save
    for p in list(ckpt.glob("*.py")):  # DeepSpeed copies zero_to_fp32.py in; HF Trainer does too, harmless
        p.unlink()
    _spec_and_commit(run, ckpt, args.stage)


def _spec_and_commit(run: Path, ckpt: Path, stage: int) -> None:
    from ftkit.checkpoint.commit import manifest_part, write_commit
    from ftkit.recipe.schema import SECTION_BY_NAME
    from ftkit.rundir.layout import RunDir
    from ftkit.rundir.sections import ResilienceSection
    from ftkit.rundir.spec import DataSpec, RunSpec

    resilience = ResilienceSection(**{f.name: f.default for f in SECTION_BY_NAME["resilience"].fields})
    spec = RunSpec(
        ftkit_version="bench",
        name="export-memory",
        recipe_hash="bench",
        world_size=1,
        hosts=[["localhost", 1]],
        stage=stage,
        offload_optimizer="none",
        offload_params="none",
        accelerator="cpu",
        backend="deepspeed",
        precision="fp32",
        resilience=resilience,
        model_path=str(ckpt),
        tokenizer_path=str(ckpt),
        model_revision=None,
        tokenizer_revision=None,
        peft=None,
        data=DataSpec(train="none", max_seq_len=512, truncate=False),
        save_total_limit=None,
        training_args={},
        fingerprint={},
    )
    (run / "ftkit").mkdir(parents=True, exist_ok=True)
    (run / "ftkit" / "spec.json").write_text(spec.to_json())
    RunDir(run).recipe.write_text(json.dumps({"train": {"precision": "fp32"}}))
    write_commit(ckpt, [manifest_part(ckpt, 0, 1)], step=1, world_size=1, stage=stage, recipe_hash="bench")


def measure(what: str, root: Path, max_shard_size: str) -> None:
    """One contender in this process; prints {"peak": VmHWM, "baseline": RSS after imports, "seconds": ...}."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.utils.zero_to_fp32 as z
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import ftkit.export as fe

    baseline = _status("VmRSS")
    t0 = time.monotonic()
    if what == "ftkit":
        fe.export(root / "run", 1, root / "ftkit-out", max_shard_size=max_shard_size, verify=False)
    elif what == "zero_to_fp32":
        z.convert_zero_checkpoint_to_fp32_state_dict(
            str(root / "run" / "checkpoint-1"), str(root / "z2f-out"), max_shard_size, safe_serialization=True
        )
    elif what == "verify":
        fe.verify_export(root / "ftkit-out")
    seconds = time.monotonic() - t0
    print(json.dumps({"peak": _status("VmHWM"), "baseline": baseline, "seconds": seconds}), flush=True)


def same_tensors(root: Path) -> str:
    from safetensors import safe_open

    def load(d: Path) -> dict[str, Any]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    out[k] = fh.get_tensor(k)
        return out

    a, b = load(root / "ftkit-out"), load(root / "z2f-out")
    if set(a) != set(b):
        return f"DIFFERENT tensor names: {sorted(set(a) ^ set(b))[:5]}"
    bad = [k for k in a if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and (a[k] == b[k]).all())]
    return f"{len(a)} tensors, bit-identical" if not bad else f"{len(bad)} tensors DIFFER, e.g. {bad[0]}"


# ----------------------------------------------------------------------------------------------- driver


def _child(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    for line in out.stdout.splitlines():
        if line.startswith("model:"):
            print(line)
    last = [x for x in out.stdout.splitlines() if x.startswith("{")]
    return json.loads(last[-1]) if last else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--dir", default=None, help="where to build (default: the system's temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the exports (printed at the end)")
    ap.add_argument("--child", nargs=2, metavar=("WHAT", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, root = args.child[0], Path(args.child[1])
        if what == "build":
            build(root, args)
        elif what == "compare":
            print(json.dumps({"same": same_tensors(root)}))
        else:
            measure(what, root, args.max_shard_size)
        return 0

    root = Path(tempfile.mkdtemp(prefix="ftkit-export-mem-", dir=args.dir))
    common = [f"--stage={args.stage}", f"--hidden={args.hidden}", f"--intermediate={args.intermediate}"]
    common += [f"--layers={args.layers}", f"--vocab={args.vocab}", f"--max-shard-size={args.max_shard_size}"]
    common += [f"--port={args.port}"]
    try:
        t0 = time.monotonic()
        _child(["--child", "build", str(root), *common])
        size = sum(p.stat().st_size for p in (root / "run" / "checkpoint-1").rglob("*") if p.is_file())
        print(
            f"checkpoint: ZeRO-{args.stage}, 1 rank, {size / 1e9:.2f} GB on disk, built in {time.monotonic() - t0:.0f}s"
        )
        rows = {w: _child(["--child", w, str(root), *common]) for w in ("ftkit", "zero_to_fp32", "verify")}
        print(f"\n{'':28} {'peak RSS':>10} {'baseline':>10} {'peak-base':>10} {'seconds':>8}")
        names = {
            "ftkit": "ftkit export --no-verify",
            "zero_to_fp32": "zero_to_fp32 (safetensors)",
            "verify": "ftkit export --verify",
        }
        for w, r in rows.items():
            print(
                f"{names[w]:28} {r['peak'] / 1e9:9.2f}G {r['baseline'] / 1e9:9.2f}G "
                f"{(r['peak'] - r['baseline']) / 1e9:9.2f}G {r['seconds']:8.1f}"
            )
        print("\nweights:", _child(["--child", "compare", str(root), *common])["same"])
        if args.keep:
            print(f"kept: {root}")
    finally:
        if args.dir is None or not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
