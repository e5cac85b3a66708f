"""Predicted vs measured communication and step time on real 2-rank CPU runs (HF Trainer + DeepSpeed, gloo).

For each recipe: ftkit builds the plan and renders the DeepSpeed config; a test copy of it gets DeepSpeed's
``comms_logger`` (``prof_all``); two ranks (plain processes with RANK/WORLD_SIZE/MASTER_* set, as torchrun would)
train a few optimizer steps with HF Trainer. After every optimizer step a callback snapshots
``deepspeed.comm.comms_logger.comms_dict`` ({op: {msg_size: [count, ...]}}), so the bytes of each step are the
difference of two snapshots (the one-time start-up broadcasts happen before the first snapshot). The first step
is dropped from timing (warm-up). :func:`measure_many` is what tests/integration/plan/test_comm_measured.py calls;
``main`` prints a table of predicted vs measured bytes and step time for ZeRO-1/2/3 x GA 1/4 x full/LoRA.

    .venv/bin/python benchmarks/step_time.py [--steps 4] [--json out.json]

Measured step time on CPU ranks is dominated by Python and gloo overheads, so the comparison of time is a sanity
check of the model's shape (which stage is slower, by roughly how much), not of its absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------------------ rank side


def _worker(job_path: str) -> None:
    """Every case of the job file, one after another in this rank process: a fresh TrainingArguments, model,
    Trainer and DeepSpeed engine each (accelerate's process-wide state reset between them), on one process group.
    The libraries' import (~7 s per rank on the dev machine) is paid once, not once per case."""
    for job in json.loads(Path(job_path).read_text())["jobs"]:
        _case(job)
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state()  # the next Trainer's Accelerator takes its own DeepSpeed plugin
        GradientState._reset_state()
        import gc

        gc.collect()


def _case(job: dict[str, Any]) -> None:
    rank = int(os.environ["RANK"])
    import functools

    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments, set_seed

    from ftkit.launch.data import collate, prepare

    set_seed(job["training_args"]["seed"])
    targs = TrainingArguments(**job["training_args"])
    import deepspeed
    import torch.distributed as tdist
    from deepspeed import comm

    if tdist.is_initialized() and not comm.is_initialized():
        deepspeed.init_distributed(dist_backend=targs.ddp_backend or None)
    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = prepare(job["data"], tokenizer, job["max_seq_len"], on_too_long="truncate")
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    if job.get("peft"):
        from peft import LoraConfig, get_peft_model

        p = job["peft"]
        model = get_peft_model(
            model,
            LoraConfig(r=p["r"], lora_alpha=p["alpha"], lora_dropout=0.0, target_modules=p["target_modules"]),
        )

    def snapshot() -> dict[str, dict[int, int]]:
        d = comm.comms_logger.comms_dict if comm.comms_logger is not None else {}
        return {op: {int(size): int(rec[0]) for size, rec in sizes.items()} for op, sizes in d.items()}

    steps: list[dict[str, Any]] = []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ARG002
            if not steps or "t1" in steps[-1]:
                steps.append({"t0": time.perf_counter(), "before": snapshot()})

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ARG002
            steps[-1]["t1"] = time.perf_counter()
            steps[-1]["after"] = snapshot()

    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=rows,
        processing_class=tokenizer,
        data_collator=functools.partial(collate, pad_id=tokenizer.pad_token_id),
        callbacks=[Probe()],
    )
    trainer.train()
    trainer.accelerator.free_memory()
    out = []
    for s in steps:
        delta: dict[str, dict[int, int]] = {}
        for op, sizes in s["after"].items():
            for size, count in sizes.items():
                n = count - s["before"].get(op, {}).get(size, 0)
                if n:
                    delta.setdefault(op, {})[size] = n
        out.append(
            {"seconds": s["t1"] - s["t0"], "calls": {op: {str(k): v for k, v in d.items()} for op, d in delta.items()}}
        )
    Path(job["out"].format(rank=rank)).write_text(json.dumps(out))


# ------------------------------------------------------------------------------------------------ controller side


def bytes_by_op(calls: dict[str, dict[str, int]]) -> dict[str, int]:
    """{op: Σ msg_size × count} for one step's logger delta."""
    return {op: sum(int(size) * n for size, n in sizes.items()) for op, sizes in calls.items()}


def _job(recipe: str, overrides: list[str], workdir: Path) -> tuple[Any, dict[str, Any]]:
    """The plan and the rank-side job of one case (its DeepSpeed config, with the comms logger, in ``workdir``)."""
    from ftkit.plan.load import load_and_plan
    from ftkit.render.deepspeed import render_deepspeed
    from ftkit.run.make_spec import training_arguments

    plan = load_and_plan(recipe, overrides)
    cfg = render_deepspeed(plan)
    cfg["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": False}
    workdir.mkdir(parents=True, exist_ok=True)
    ds_path = workdir / "ds_config.json"
    ds_path.write_text(json.dumps(cfg, indent=2))
    targs = training_arguments(plan, str(workdir / "out"), str(ds_path))
    targs.update(save_strategy="no", logging_steps=1000)
    r = plan.recipe
    peft = None
    if r.has_peft:
        peft = {"r": r["peft.r"], "alpha": r["peft.alpha"], "target_modules": r["peft.target_modules"]}
    job = {
        "training_args": targs,
        "model": r["model.path"],
        "tokenizer": r["model.tokenizer"] or r["model.path"],
        "data": r["data.train"],
        "max_seq_len": r["data.max_seq_len"],
        "peft": peft,
        "out": str(workdir / "rank{rank}.json"),
    }
    return plan, job


def measure_many(recipe: str, cases: dict[str, list[str]], root: Path, timeout: float = 900) -> dict[str, Any]:
    """Run each case (name -> overrides; its files in ``root/name``) on the same 2 CPU ranks, one after another,
    with the comms logger; return name -> the plan's prediction and each rank's steps."""
    from ftkit.plan.candidates import predict_plan

    plans, jobs = {}, []
    for name, overrides in cases.items():
        plans[name], job = _job(recipe, overrides, root / name)
        jobs.append(job)
    root.mkdir(parents=True, exist_ok=True)
    job_path = root / "jobs.json"
    job_path.write_text(json.dumps({"jobs": jobs}))
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
        }
        log = open(root / f"rank{rank}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(job_path)], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        )
    end = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1, end - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        tail = (root / "rank0.log").read_text()[-3000:]
        raise RuntimeError(f"rank failed ({[p.returncode for p in procs]}):\n{tail}")
    return {
        name: {
            "plan": plan,
            "prediction": predict_plan(plan),
            "ranks": [json.loads((root / name / f"rank{i}.json").read_text()) for i in range(2)],
        }
        for name, plan in plans.items()
    }


def measure(recipe: str, overrides: list[str], workdir: Path, timeout: float = 900) -> dict[str, Any]:
    """One case: :func:`measure_many` with its files in ``workdir``."""
    return measure_many(recipe, {workdir.name: overrides}, workdir.parent, timeout)[workdir.name]


CASES = [(stage, ga, peft) for peft in (False, True) for stage in (1, 2, 3) for ga in (1, 4)]


def case_overrides(stage: int, ga: int, peft: bool, steps: int) -> list[str]:
    # 2 ranks x micro 4: global batch 8 at GA 1, 32 at GA 4
    o = [f"zero.stage={stage}", f"train.global_batch_size={8 * ga}", f"train.max_steps={steps}"]
    if peft:
        o += ["peft.method=lora", "peft.r=8", "peft.target_modules=[q_proj,v_proj]"]
    return o


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", help="stage,ga,peft e.g. 3,4,lora")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    from tests.helpers.runs import make_fixtures, mp_lock, write_recipe

    rows = []
    with tempfile.TemporaryDirectory() as tmp, mp_lock():
        root = Path(tmp)
        fixtures = make_fixtures(root / "fx")
        recipe = write_recipe(root, fixtures, zero__overlap_comm=False)
        cases = CASES
        if args.only:
            st, ga, kind = args.only.split(",")
            cases = [(int(st), int(ga), kind == "lora")]
        named = {f"zero{st}-ga{ga}-{'lora' if lora else 'full'}": (st, ga, lora) for st, ga, lora in cases}
        results = measure_many(str(recipe), {n: case_overrides(*c, args.steps) for n, c in named.items()}, root)
        for name, res in results.items():
            pred = res["prediction"]
            steps = res["ranks"][0][1:] or res["ranks"][0]
            measured = bytes_by_op(steps[-1]["calls"])
            secs = sorted(s["seconds"] for s in steps)[len(steps) // 2]
            row = {
                "case": name,
                "predicted_bytes": pred.logger_bytes,
                "measured_bytes": measured,
                "predicted_step_s": pred.step_time_s,
                "measured_step_s": secs,
                "calls": steps[-1]["calls"],
            }
            rows.append(row)
            measured.pop("broadcast", None)  # HF Trainer's own small broadcasts
            err = {op: (measured.get(op, 0) - b) / b for op, b in pred.logger_bytes.items() if b}
            row["bytes_error"] = err
            print(
                f"{name:<16} bytes/step predicted {pred.logger_bytes}\n{'':<16} measured {measured} "
                f"(error {', '.join(f'{op} {e:+.1%}' for op, e in err.items())})\n{'':<16} step time measured "
                f"{secs:.3f} s, predicted {pred.step_time_s:.3f} s ({(pred.step_time_s - secs) / secs:+.0%})",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
