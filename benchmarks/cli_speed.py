"""Wall time of the config-only commands (they must not import torch & co): median of N runs each.

    python benchmarks/cli_speed.py [--runs 15]

Each run is a fresh `python -m ftkit ...` process, as a user or a CI job runs it, against the shipped LoRA
template with a Llama-3-8B config.json (closed-form parameter count). Prints one line per command and the import
time of `ftkit.cli.main` from `python -X importtime`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def median_time(argv: list[str], runs: int, env: dict[str, str] | None = None) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "model").mkdir()
        shutil.copy(REPO / "tests/fixtures/model_configs/Meta-Llama-3-8B.json", root / "model/config.json")
        shutil.copy(REPO / "templates/lora.yaml", root / "recipe.yaml")
        recipe = str(root / "recipe.yaml")
        py = [sys.executable, "-m", "ftkit"]
        subprocess.run([*py, "render", recipe], check=True, capture_output=True)
        # the same config.json as a cached hub id (huggingface_hub's cache layout, HF_HUB_OFFLINE=1)
        repo = root / "hf" / "hub" / "models--meta-llama--Meta-Llama-3-8B"
        commit = "0" * 40
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        shutil.copy(root / "model/config.json", repo / "snapshots" / commit / "config.json")
        (root / "hub").mkdir()
        text = (root / "recipe.yaml").read_text().replace("path: ./model", "path: meta-llama/Meta-Llama-3-8B", 1)
        (root / "hub" / "recipe.yaml").write_text(text)
        hub_env = {**os.environ, "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"}
        hub_recipe = str(root / "hub" / "recipe.yaml")
        subprocess.run([*py, "render", hub_recipe], check=True, capture_output=True, env=hub_env)
        rows = [
            ("python -c pass (interpreter floor)", [sys.executable, "-c", "pass"]),
            ("ftkit --help", [*py, "--help"]),
            ("ftkit render", [*py, "render", recipe]),
            ("ftkit check", [*py, "check", recipe]),
            ("ftkit plan", [*py, "plan", recipe]),
            ("ftkit explain", [*py, "explain", recipe]),
        ]
        print(f"median of {args.runs} runs each")
        for label, argv in rows:
            print(f"  {label:<38} {median_time(argv, args.runs) * 1000:7.1f} ms")
        t = median_time([*py, "render", hub_recipe], args.runs, env=hub_env)
        print(f"  {'ftkit render (hub id, cached, offline)':<38} {t * 1000:7.1f} ms")
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import ftkit.cli.main"],
            capture_output=True,
            text=True,
            check=True,
        )
        last = [line for line in out.stderr.splitlines() if line.rstrip().endswith("ftkit.cli.main")]
        if last:
            cumulative_us = int(last[-1].split("|")[1])
            print(f"  import ftkit.cli.main (cumulative, -X importtime) {cumulative_us / 1000:7.1f} ms")
        heavy = [
            m
            for m in ("torch", "deepspeed", "transformers", "accelerate", "peft")
            if any(line.rstrip().endswith(f" {m}") for line in out.stderr.splitlines())
        ]
        print(f"  heavy modules imported by the CLI: {heavy or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
