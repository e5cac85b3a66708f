"""``ftkit doctor`` as the tests run it: the command with only the environment a test sets, a recipe on this machine
(2 CPU ranks of the tiny model, cluster keys as given), a stale build lock, a rank holding one, and the failure lines
it printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.recipes import TINY_LLAMA


def clean_ftkit(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 90):
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | (env or {})  # only what a test sets
    return subprocess.run(
        [sys.executable, "-m", "ftkit", *args], env=e, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def build_lock(root: Path, op: str) -> Path:
    """A torch extension build lock (``ROOT/OP/lock``) as a killed build leaves it."""
    d = root / op
    d.mkdir(parents=True)
    p = d / "lock"
    p.write_text("")
    return p


def holding_rank(records: Path, lock: Path, *, give_back: bool = False) -> subprocess.Popen:
    """A process with a rank's start-up (``install_startup``: the locks it takes are recorded in ``records``) that
    takes torch's own build baton on ``lock``, says ``held`` (and ``given back`` after releasing it if asked), then
    sleeps until killed. Its other output (the start-up's lines) comes first."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from ftkit.launch.rank import install_startup\n"
        f"install_startup('cpu', Path({str(records)!r}))\n"
        "from torch.utils.file_baton import FileBaton\n"
        f"b = FileBaton({str(lock)!r})\n"
        "print('held' if b.try_acquire() else 'busy', flush=True)\n"
        f"if {give_back}:\n"
        "    b.release(); print('given back', flush=True)\n"
        "time.sleep(300)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen, last: str) -> list[str]:
    """The lines ``proc`` printed up to and including ``last`` (or up to its end)."""
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if lines[-1] == last:
            break
    return lines


def local_recipe(d: Path, **cluster) -> Path:
    model = d / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    recipe = {
        "model": {"path": str(model)},
        "data": {"train": str(d / "data.jsonl")},
        "train": {"output_dir": str(d / "run"), "precision": "fp32", "micro_batch_size": 2, "global_batch_size": 4},
        "cluster": {"gpus_per_node": 2, "accelerator": "cpu", "gpu_memory_gb": 8, "host_memory_gb": 16}
        | {k: str(v) if isinstance(v, Path) else v for k, v in cluster.items()},
    }
    (d / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return d / "recipe.yaml"


def failures(out) -> list[str]:
    return [ln.removeprefix("ftkit: error: ") for ln in out.stderr.splitlines() if ln.startswith("ftkit: error: ")]
