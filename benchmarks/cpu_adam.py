"""How fast is an offloaded optimizer step on the CPU, per parameter: DeepSpeed's CPU Adam against torch's AdamW?

With optimizer offload, every optimizer step runs on the host: DeepSpeed's ``DeepSpeedCPUAdam`` (a JIT-built AVX
kernel, ``zero.cpu_adam: true``) or, where it cannot be built, torch's ``AdamW`` on the CPU (``zero.cpu_adam: false``).
The step-time model prices each (``ftkit.plan.speed``: ``cpu_adam_params_per_s``, ``torch_adam_params_per_s``); this
measures both on fp32 parameters (fp32 master, exp_avg, exp_avg_sq, fp32 gradient: what ZeRO keeps on the host).

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/cpu_adam.py [--params 50e6] [--steps 5] [--threads N]

Prints parameters per second per implementation, and per core. Needs the CPU Adam op built (``make install`` builds
it into ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=50e6, help="parameters in the step (one flat tensor)")
    ap.add_argument("--tensors", type=int, default=1, help="split into this many tensors")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    n = int(args.params) // args.tensors
    results = {}
    for impl in ("deepspeed-cpu-adam", "torch-adamw", "torch-adamw-foreach", "torch-adamw-fused"):
        params = [torch.nn.Parameter(torch.randn(n)) for _ in range(args.tensors)]
        for p in params:
            p.grad = torch.randn(n)
        if impl == "deepspeed-cpu-adam":
            try:
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                opt = DeepSpeedCPUAdam(params, lr=1e-3)
            except Exception as e:  # noqa: BLE001 - report and go on with torch's
                print(f"{impl}: not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                continue
        elif impl.endswith("fused"):  # what ftkit renders for zero.cpu_adam false (torch_adam + fused)
            opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        else:
            opt = torch.optim.AdamW(params, lr=1e-3, foreach=impl.endswith("foreach"))
        opt.step()  # warm-up: state allocation, first touch
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        best = sorted(times)[len(times) // 2]
        rate = n * args.tensors / best
        results[impl] = rate
        print(
            f"{impl:<22} {best * 1000:8.1f} ms per step of {n * args.tensors / 1e6:.0f}M parameters: "
            f"{rate / 1e6:8.1f} M params/s ({rate / 1e6 / args.threads:.1f} M/s per thread, {args.threads} threads)"
        )
    for other in ("torch-adamw", "torch-adamw-fused"):
        if "deepspeed-cpu-adam" in results and other in results:
            print(f"CPU Adam is {results['deepspeed-cpu-adam'] / results[other]:.1f}x {other} here")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
