"""``make gpu-check``: ftkit on one real CUDA GPU, checked against its own promises, in about 8 minutes.

What a CPU suite cannot see (../shared/GPU.md): what the ranks run on CUDA (the optimizer, compiled ops, the
environment, precision), and whether ``ftkit plan``'s numbers are those of the GPU. For each case below, on a
random-weight model built from a config (a 0.27B Llama: the shape of the first GPU measurement, 2026-11-27), world
size 1, bf16, micro batch 8 of 1024 tokens:

1. ``ftkit plan --json``: the predicted memory per GPU (device total, and the allocator's part where the plan gives
   it) and step time;
2. ``ftkit launch`` with the rank SIGKILLed after step 10 (``FTKIT_FAULT_INJECT=kill:0:10``), resumed by the
   supervisor; while it runs ``nvidia-smi`` is sampled every 0.2 s (the device total: CUDA context, cuBLAS
   workspace, NCCL included);
3. read back: the allocator's and reserved peaks the rank logged (``mem_peak``, ``mem_reserved_peak`` in
   metrics.jsonl), the median step time (steps that saved left out), the tier the resume came from, and the
   recomputed step's loss against the killed attempt's.

Cases: ZeRO-0/1/2/3, ZeRO-2 + optimizer offload, ZeRO-3 + full offload, LoRA ZeRO-3, FSDP2. Then the failure cases
of the first GPU run: the default config with no CUDA toolkit visible (it must train: nothing to compile), CPU Adam
required with no toolkit (ftkit's one-line refusal, exit 3, before any rank), and ``TORCH_CUDA_ARCH_LIST=9.0a``
with CPU Adam required (the ranks get ``9.0`` and train). Hiding the toolkit needs a private mount namespace
(``unshare -m``, root); without one that case says so.

The table (date, GPU, versions) is appended to ``docs/accuracy.md`` (``--out``) and the raw results written as JSON
(``--json``). Without a CUDA GPU it says so and exits 0. ``--rehearse`` runs the same flow on CPU ranks with a tiny
model and two cases (GPU minutes are scarce: spend them on measurements, not on bugs).

Exit status: 0 when every case behaved as promised (or no GPU), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
KILL_AT = 10
STEPS = 12

# The shape of the first GPU measurement (../shared/gpu/measurements-2026-11-27.json): 271,090,688 parameters
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
LORA = {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                                                    "o_proj"]}  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    values: dict[str, object]
    lora: bool = False


CASES = (
    Case("zero0", {"zero.stage": 0}),
    Case("zero1", {"zero.stage": 1}),
    Case("zero2", {"zero.stage": 2}),
    Case("zero3", {"zero.stage": 3}),
    Case("zero2-offload-optimizer", {"zero.stage": 2, "zero.offload_optimizer": "cpu"}),
    Case("zero3-offload-all", {"zero.stage": 3, "zero.offload_optimizer": "cpu", "zero.offload_params": "cpu"}),
    Case("lora-zero3", {"zero.stage": 3}, lora=True),
    Case("fsdp2", {"train.backend": "fsdp2", "cluster.engine": "accelerate"}),
)


@dataclass
class Result:
    case: str
    exit_code: int | None = None
    seconds: float = 0.0
    predicted: dict[str, float | None] = field(default_factory=dict)  # device_gib, allocator_gib, step_s
    measured: dict[str, float | None] = field(default_factory=dict)  # device_gib, allocator_gib, reserved_gib, step_s
    resume_tier: str | None = None
    recomputed: dict[str, float | int | None] = field(default_factory=dict)  # step, loss diff
    ok: bool = False
    note: str = ""


# ------------------------------------------------------------------------------------------------ reading results


def read_jsonl(path: Path) -> list[dict[str, object]]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def step_time(metrics: list[dict[str, object]], save_every: int) -> float | None:
    """The median time between consecutive logged steps of one attempt (the first attempt's, else any), steps that
    saved (a multiple of ``save_every``) and the first of each attempt left out."""
    by_attempt: dict[object, list[tuple[int, float]]] = {}
    for m in metrics:
        step, t = m.get("step"), m.get("time")
        if "loss" in m and isinstance(step, int) and isinstance(t, (int, float)):
            by_attempt.setdefault(m.get("attempt"), []).append((step, float(t)))
    deltas = []
    for rows in by_attempt.values():
        rows.sort()
        for (s0, t0), (s1, t1) in zip(rows, rows[1:], strict=False):
            if s1 == s0 + 1 and s1 > 1 and (save_every <= 0 or s1 % save_every):
                deltas.append(t1 - t0)
    return statistics.median(deltas) if deltas else None


def memory_peaks(metrics: list[dict[str, object]]) -> tuple[float | None, float | None]:
    """(allocator peak, reserved peak) in GiB: the largest the rank logged."""
    alloc = [m["mem_peak"] for m in metrics if isinstance(m.get("mem_peak"), int)]
    res = [m["mem_reserved_peak"] for m in metrics if isinstance(m.get("mem_reserved_peak"), int)]
    return (max(alloc) / GIB if alloc else None, max(res) / GIB if res else None)  # type: ignore[type-var,operator]


def resume_tier(events: list[dict[str, object]]) -> str | None:
    """Where the restart resumed from: the tier of the first ``checkpoint_chosen`` after the first attempt."""
    for e in events:
        if e.get("event") == "checkpoint_chosen" and isinstance(e.get("attempt"), int) and e["attempt"] > 0:
            return str(e.get("tier") or "durable")
    return None


def recomputed(metrics: list[dict[str, object]]) -> dict[str, float | int | None]:
    """The steps the resumed attempt logged again: the largest absolute loss difference, and at which step."""
    first: dict[int, float] = {}
    worst: tuple[int, float] | None = None
    for m in metrics:
        step, loss, attempt = m.get("step"), m.get("loss"), m.get("attempt")
        if not (isinstance(step, int) and isinstance(loss, (int, float)) and isinstance(attempt, int)):
            continue
        if attempt == 0:
            first[step] = float(loss)
        elif step in first:
            d = abs(float(loss) - first[step])
            if worst is None or d > worst[1]:
                worst = (step, d)
    return {"step": worst[0], "loss_diff": worst[1]} if worst else {"step": None, "loss_diff": None}


def predicted(plan: dict[str, object], case: Case) -> dict[str, float | None]:
    """The chosen candidate's numbers from ``ftkit plan --json`` (the plan's device total when it reports one)."""
    cands = plan.get("candidates")
    chosen = plan.get("chosen") if isinstance(plan.get("chosen"), dict) else None
    row = chosen
    if row is None and isinstance(cands, list):
        row = next((c for c in cands if isinstance(c, dict) and c.get("chosen")), cands[0] if cands else None)
    if not isinstance(row, dict):
        return {}

    def num(*keys: str) -> float | None:
        for k in keys:
            v = row.get(k)
            if isinstance(v, (int, float)):
                return float(v)
        return None

    return {
        "device_gib": num("device_gib", "gpu_gib"),
        "allocator_gib": num("allocator_gib"),
        "step_s": num("step_time_s"),
    }


def parse_smi_mib(text: str) -> int | None:
    """``nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits`` -> MiB of the first GPU."""
    for line in text.splitlines():
        line = line.strip()
        if line.isdigit():
            return int(line)
    return None


def error_pct(pred: float | None, meas: float | None) -> str:
    if pred is None or meas is None or meas == 0:
        return "-"
    return f"{(pred - meas) / meas * 100:+.0f}%"


def table(results: list[Result], machine: dict[str, str]) -> str:
    """The Markdown section appended to docs/accuracy.md."""

    def f(v: float | int | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    v = {k: machine.get(k, "?") for k in ("torch", "deepspeed", "transformers", "accelerate", "peft", "ftkit")}
    m = {k: machine.get(k, "?") for k in ("date", "gpu", "commit", "model", "workload")}
    lines = [
        f"## make gpu-check, {m['date']}: {m['gpu']}",
        "",
        ", ".join(f"{k} {ver}" for k, ver in v.items())
        + f" ({m['commit']}); a {m['model']}, world size 1, {m['workload']}; the rank SIGKILLed after step {KILL_AT}"
        " and resumed.",
        "",
        "| case | exit | device GiB pred / meas (err) | allocator GiB pred / meas | reserved GiB | step s pred / meas "
        "(err) | resume tier | recomputed step: loss diff | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, meas = r.predicted, r.measured
        rec = r.recomputed
        lines.append(
            f"| {r.case} | {f(r.exit_code, 'd')} | {f(p.get('device_gib'))} / {f(meas.get('device_gib'))} "
            f"({error_pct(p.get('device_gib'), meas.get('device_gib'))}) | {f(p.get('allocator_gib'))} / "
            f"{f(meas.get('allocator_gib'))} | {f(meas.get('reserved_gib'))} | {f(p.get('step_s'), '.3f')} / "
            f"{f(meas.get('step_s'), '.3f')} ({error_pct(p.get('step_s'), meas.get('step_s'))}) | "
            f"{r.resume_tier or '-'} | "
            f"{f(rec.get('step'), 'd')}: {f(rec.get('loss_diff'), '.2g')} | {'yes' if r.ok else 'NO'}"
            + (f": {' '.join(r.note.split())}" if r.note else "")
            + " |"
        )
    return "\n".join(lines) + "\n"


def append_table(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` (created with a heading when absent)."""
    head = "" if path.exists() else "# ftkit's numbers against real hardware\n\n"
    with open(path, "a") as fh:
        fh.write(head + ("\n" if path.exists() and path.stat().st_size else "") + text)


# ------------------------------------------------------------------------------------------------ the machine


def cuda_gpu() -> str | None:
    """The first GPU's ``name, driver`` when nvidia-smi sees one and torch can use it; None otherwise."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    if subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode != 0:
        return None
    return out.splitlines()[0]


class SmiSampler:
    """The peak of ``nvidia-smi``'s memory.used on GPU 0, sampled every 0.2 s while running."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SmiSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        args = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
        while not self._stop.is_set():
            try:
                used = parse_smi_mib(subprocess.run(args, capture_output=True, text=True, timeout=5).stdout)
            except (OSError, subprocess.SubprocessError):
                used = None
            if used is not None:
                self.peak_mib = max(self.peak_mib, used)
            self._stop.wait(0.2)


# ------------------------------------------------------------------------------------------------ running


def ftkit(*args: str, env: dict[str, str] | None = None, timeout: float = 600, wrap: list[str] | None = None):
    argv = [*(wrap or []), sys.executable, "-m", "ftkit", *args]
    return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)


def build_fixtures(root: Path, rehearse: bool) -> tuple[Path, Path]:
    """(model directory, data file): the 0.27B model (random weights) or, rehearsing, the tests' tiny one; rows of
    at least the sequence length."""
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from ftkit.launch.fixtures import make_tokenizer, make_tiny_model\n"
        "root = Path(sys.argv[1]); rehearse = sys.argv[2] == '1'\n"
        "if rehearse:\n"
        "    make_tiny_model(root / 'model')\n"
        "else:\n"
        "    import torch\n"
        "    from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "    torch.manual_seed(0)\n"
        f"    cfg = LlamaConfig(**{MODEL_CONFIG!r})\n"
        "    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)\n"
        "    model.save_pretrained(root / 'model')\n"
        "    make_tokenizer(root / 'model')\n"
    )
    subprocess.run([sys.executable, "-c", code, str(root), "1" if rehearse else "0"], check=True, timeout=900)
    words = " ".join(f"the color of the sky is blue and count from one two three {i}" for i in range(200))
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": words}) + "\n" for _ in range(256)))
    return root / "model", data


def _free_port() -> int:
    """A port nothing listens on now: each case's rendezvous gets its own (a killed case's port may linger)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recipe(root: Path, case: Case, model: Path, data: Path, rehearse: bool, extra: dict[str, object]) -> Path:
    values: dict[str, dict[str, object]] = {
        "model": {"path": str(model)},
        "data": {"train": str(data), "max_seq_len": 64 if rehearse else 1024, "truncate": True},
        "train": {
            "output_dir": str(root / case.name / "run"),
            "precision": "fp32" if rehearse else "bf16",
            "micro_batch_size": 2 if rehearse else 8,
            "global_batch_size": 2 if rehearse else 8,
            "max_steps": STEPS,
            "learning_rate": 1e-4,
            "logging_steps": 1,
            "save_steps": 8,
            "seed": 7,
        },
        "checkpoint": {"local_steps": 4},
        "cluster": {
            "gpus_per_node": 1,
            "accelerator": "cpu" if rehearse else "cuda",
            "gpu_memory_gb": 8 if rehearse else 140,
            "host_memory_gb": 16 if rehearse else 256,
            "master_port": _free_port(),
        },
        "resilience": {"max_restarts": 2, "backoff_s": 0.5, "backoff_max_s": 2},
    }
    for key, v in {**case.values, **extra}.items():
        section, _, name = str(key).partition(".")
        values.setdefault(section, {})[name] = v
    if case.lora:
        values["peft"] = dict(LORA)
    p = root / case.name / "recipe.yaml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(values, sort_keys=False))
    return p


def run_case(root: Path, case: Case, model: Path, data: Path, rehearse: bool) -> Result:
    res = Result(case.name)
    r = recipe(root, case, model, data, rehearse, {})
    plan = ftkit("plan", str(r), "--json", timeout=300)
    try:
        res.predicted = predicted(json.loads(plan.stdout), case)
    except ValueError:
        res.note = f"ftkit plan failed: {(plan.stderr or plan.stdout).strip()[-200:]}"
    t0 = time.monotonic()
    sampler = SmiSampler() if not rehearse else None
    if sampler:
        sampler.__enter__()
    try:
        out = ftkit("launch", str(r), env={"FTKIT_FAULT_INJECT": f"kill:0:{KILL_AT}"}, timeout=900)
    finally:
        if sampler:
            sampler.__exit__()
    res.seconds = round(time.monotonic() - t0, 1)
    res.exit_code = out.returncode
    run = root / case.name / "run"
    metrics, events = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "events.jsonl")
    alloc, reserved = memory_peaks(metrics)
    res.measured = {
        "device_gib": sampler.peak_mib / 1024 if sampler and sampler.peak_mib else None,
        "allocator_gib": alloc,
        "reserved_gib": reserved,
        "step_s": step_time(metrics, 8),
    }
    res.resume_tier = resume_tier(events)
    res.recomputed = recomputed(metrics)
    diff = res.recomputed.get("loss_diff")
    res.ok = out.returncode == 0 and res.resume_tier is not None and diff is not None and diff <= 1e-2
    if out.returncode != 0:
        res.note = (res.note + " " + out.stdout.strip().splitlines()[-1] if out.stdout.strip() else res.note).strip()
    return res


def hidden_toolkit_wrap() -> list[str] | None:
    """argv that runs a command with no CUDA toolkit visible (tmpfs over every toolkit directory, in a private mount
    namespace), or None when this machine cannot (no unshare, not root)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return None
    dirs = {str(p.resolve()) for p in Path("/usr/local").glob("cuda*") if p.is_dir()}  # a link cannot be a mount point
    nvcc = shutil.which("nvcc")
    if nvcc:
        dirs.add(str(Path(nvcc).resolve().parent.parent))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and Path(os.environ[var]).is_dir():
            dirs.add(str(Path(os.environ[var]).resolve()))
    mounts = " && ".join(f"mount -t tmpfs tmpfs {d}" for d in sorted(dirs)) or "true"
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "hide-cuda"]


def failure_cases(root: Path, model: Path, data: Path, rehearse: bool) -> list[Result]:
    out: list[Result] = []
    wrap = hidden_toolkit_wrap()
    no_cuda = {"CUDA_HOME": "", "CUDA_PATH": ""}
    specs = [
        ("no-toolkit-default", Case("no-toolkit-default", {"zero.stage": 2}), no_cuda, wrap, 0, "train"),
        (
            "no-toolkit-cpu-adam",
            Case("no-toolkit-cpu-adam", {"zero.stage": 2, "zero.offload_optimizer": "cpu", "zero.cpu_adam": True}),
            no_cuda,
            wrap,
            3,
            "no CUDA toolkit",
        ),
        (
            "arch-9.0a-cpu-adam",
            Case("arch-9.0a-cpu-adam", {"zero.stage": 2, "zero.offload_optimizer": "cpu", "zero.cpu_adam": True}),
            {"TORCH_CUDA_ARCH_LIST": "9.0a"},
            None,
            0,
            "TORCH_CUDA_ARCH_LIST=9.0 instead of '9.0a'",
        ),
    ]
    for name, case, env, how, want, expect in specs:
        res = Result(name)
        if how is None and name.startswith("no-toolkit"):
            res.note = "skipped: hiding the CUDA toolkit needs unshare and root"
            out.append(res)
            continue
        if rehearse and want == 3:
            res.note = "skipped: a GPU's case (CPU ranks build CPU Adam with no CUDA toolkit)"
            out.append(res)
            continue
        r = recipe(root, case, model, data, rehearse, {"train.max_steps": 4})
        t0 = time.monotonic()
        env = {**env, "PATH": os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if not (
            Path(p) / "nvcc").exists())} if name.startswith("no-toolkit") else env  # fmt: skip
        done = ftkit("launch", str(r), env=env, wrap=how, timeout=900)
        res.seconds = round(time.monotonic() - t0, 1)
        res.exit_code = done.returncode
        said = done.stdout + done.stderr
        res.ok = done.returncode == want and (expect == "train" or expect in said)
        last = [ln for ln in said.splitlines() if ln.startswith("ftkit: ")]
        res.note = (last[-1] if last else said.strip()[-200:])[:300]
        out.append(res)
    return out


def machine_facts(gpu: str, rehearse: bool) -> dict[str, str]:
    sys.path.insert(0, str(REPO))
    from ftkit.cluster.pkgversions import versions

    facts = {k: v for k, v in versions().items()}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    facts.update(
        date=datetime.now(UTC).strftime("%Y-%m-%d"),
        gpu=gpu,
        commit=commit.stdout.strip() or "?",
        model="tiny Llama (rehearsal on CPU)" if rehearse else "0.27B Llama (random weights)",
        workload="fp32, micro batch 2 x 64 tokens" if rehearse else "bf16, micro batch 8 x 1024 tokens",
    )
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "accuracy.md"), help="the Markdown file to append to")
    ap.add_argument("--json", default=None, help="write every result as JSON here too")
    ap.add_argument("--cases", default="all", help="comma-separated case names (default: all), or none")
    ap.add_argument("--no-failures", action="store_true", help="skip the failure cases")
    ap.add_argument("--rehearse", action="store_true", help="CPU ranks, a tiny model, zero2 and fsdp2 only")
    ap.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory)")
    args = ap.parse_args(argv)

    gpu = "CPU rehearsal" if args.rehearse else cuda_gpu()
    if gpu is None:
        print("gpu-check: no CUDA GPU here (nvidia-smi finds none, or torch cannot use it): nothing to check; "
              "run it on a machine with a GPU (../shared/GPU.md)")  # fmt: skip
        return 0
    names = [c.name for c in CASES] if args.cases == "all" else [n for n in args.cases.split(",") if n and n != "none"]
    if args.rehearse and args.cases == "all":
        names = ["zero2", "fsdp2"]
    cases = [c for c in CASES if c.name in names]
    root = Path(args.workdir or tempfile.mkdtemp(prefix="ftkit-gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    env_note = "DS_ACCELERATOR=cpu" if args.rehearse else ""
    if args.rehearse:
        os.environ["DS_ACCELERATOR"] = "cpu"
    print(f"gpu-check: {gpu}; runs in {root} {env_note}".rstrip(), flush=True)
    model, data = build_fixtures(root, args.rehearse)
    results: list[Result] = []
    for case in cases:
        res = run_case(root, case, model, data, args.rehearse)
        print(f"gpu-check: {case.name}: exit {res.exit_code}, {res.seconds}s, {res.measured}, ok={res.ok}", flush=True)
        results.append(res)
    if not args.no_failures:
        for res in failure_cases(root, model, data, args.rehearse):
            print(f"gpu-check: {res.case}: exit {res.exit_code}, ok={res.ok}: {res.note}", flush=True)
            results.append(res)
    facts = machine_facts(gpu, args.rehearse)
    append_table(Path(args.out), table(results, facts))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": facts, "results": [r.__dict__ for r in results]}, indent=1))
    print(f"gpu-check: table appended to {args.out}")
    return 0 if all(r.ok or r.note.startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
