"""How close is ftkit.plan.memory's per-GPU estimate to what PyTorch really allocates?

Builds a small Llama from a config (no downloads), runs a few DeepSpeed training steps at each ZeRO stage in a
single process (world size 1) and compares ``torch.cuda.max_memory_allocated`` with the estimate's allocator
peak (the largest phase of a step: ``Estimate.allocator_bytes``; the reserve and the CUDA context, which
``max_memory_allocated`` does not see, are left out). Peak memory is reset after ``deepspeed.initialize`` so loading
transients do not count: the estimate models the training steady state.

Usage::

    python benchmarks/memory_accuracy.py [--hidden 1024 --layers 8 --seq 512 --micro-batch 4 --steps 3 --ckpt]

Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftkit.model.shape import count_params  # noqa: E402
from ftkit.plan.memory import Candidate, GiB, Workload, estimate  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing")
    ap.add_argument("--stages", default="1,2,3")
    args = ap.parse_args(argv)

    try:
        import torch
    except ImportError:
        print("no CUDA device: nothing to measure (torch is not installed)")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0

    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl")

    cfg = dict(
        model_type="llama",
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
    )
    shape = count_params(cfg)
    print(
        f"model: llama h={args.hidden} layers={args.layers} Ψ={shape.total_params:,}; b={args.micro_batch} "
        f"s={args.seq} ckpt={args.ckpt} bf16, world size 1, device {torch.cuda.get_device_name()}"
    )
    header = f"{'candidate':<12}{'predicted GiB':>14}{'measured GiB':>14}{'error':>9}   components (GiB)"
    print(header)
    print("-" * len(header))
    for stage in (int(s) for s in args.stages.split(",")):
        cand = Candidate(stage)
        w = Workload(
            shape,
            world_size=1,
            gpus_per_node=1,
            micro_batch_size=args.micro_batch,
            seq_len=args.seq,
            precision="bf16",
            gradient_checkpointing=args.ckpt,
        )
        est = estimate(cand, w)
        predicted = est.allocator_bytes

        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}, attn_implementation="sdpa")
        )
        if args.ckpt:
            model.gradient_checkpointing_enable()
        ds_config = {
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": args.hidden**2,
                "stage3_prefetch_bucket_size": int(0.9 * args.hidden**2),
                "stage3_param_persistence_threshold": 10 * args.hidden,
                "overlap_comm": stage == 3,
                "contiguous_gradients": True,
            },
        }
        # torch's fused AdamW: no JIT-built DeepSpeed op needed, and no foreach temporaries to distort the peak
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), device=engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
        parts = " ".join(
            f"{k}={v / GiB:.2f}" for k, v in est.components.items() if v and k not in ("reserved", "context")
        )
        print(
            f"{cand.label:<12}{predicted / GiB:>14.2f}{measured / GiB:>14.2f}{(predicted / measured - 1):>9.1%}   "
            f"{parts}"
        )
        engine.destroy()
        del engine, model, optimizer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
