"""What importing DeepSpeed makes every rank load, and what a rank (``ftkit.hf.start``) leaves for later or out.

``deepspeed.initialize``'s optimizer check imports DeepSpeed's Muon optimizer, whose kernels are
``torch.compile``-decorated at import. In a rank the decorator is applied at each kernel's first call: importing the
module loads no TorchInductor, and the first call still goes through DeepSpeed's own decorator
(``deepspeed.runtime.compiler.compile``). DeepSpeed's autotuner imports mlflow with every ``import deepspeed``; a
rank, a user's script's too, imports it without, and mlflow stays importable for the script's own use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

pytestmark = pytest.mark.heavy  # imports torch and DeepSpeed in a subprocess (seconds)

PROGRAM = """
import sys, torch
import ftkit.hf
ftkit.hf.start(sys.argv[1], 0, log_to_console=True)
from deepspeed.runtime.zero.muon import original_muon
print("inductor at import:", "torch._inductor.compile_fx" in sys.modules, flush=True)
decorated = []
def record(fn=None, **kwargs):  # stands in for torch.compile: what DeepSpeed's decorator hands it, then eager
    decorated.append(fn.__name__)
    return fn
torch.compile = record
g = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
got = original_muon.zeropower_via_newtonschulz5(g, steps=2)
again = original_muon.zeropower_via_newtonschulz5(g, steps=2)
eager = original_muon.zeropower_via_newtonschulz5.__wrapped__(g, steps=2)
print("decorated:", decorated, flush=True)
print("same as eager:", bool(torch.equal(got, eager) and torch.equal(again, eager)), flush=True)
"""


def _run_rank(program: str, run_dir: Path) -> tuple[dict[str, str], str]:
    """``program`` in a fresh interpreter on a CPU rank of ``run_dir``: its ``name: value`` lines, and its output's
    tail for the assertion messages."""
    r = subprocess.run(
        [sys.executable, "-c", program, str(run_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    said = dict(x.split(": ", 1) for x in r.stdout.splitlines() if ": " in x)
    return said, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_rank_loads_the_compiler_only_when_a_compiled_kernel_is_first_called(
    spec_run_dir: Path,
) -> None:
    said, out = _run_rank(PROGRAM, spec_run_dir)
    assert said.get("inductor at import") == "False", out
    assert said.get("decorated") == "['zeropower_via_newtonschulz5']", out  # once, at the first call
    assert said.get("same as eager") == "True", out


SCRIPT_RANK = """
import sys
import ftkit.hf
ftkit.hf.start(sys.argv[1], 0, log_to_console=True)
import deepspeed.autotuning.autotuner as autotuner
print("mlflow imported with deepspeed:", "mlflow" in sys.modules, flush=True)
print("autotuner has mlflow:", autotuner.has_mlflow, flush=True)
import mlflow
print("mlflow importable after:", callable(mlflow.start_run), flush=True)
"""


def test_a_script_rank_imports_deepspeed_without_mlflow_and_the_script_can_still_import_it(
    spec_run_dir: Path,
) -> None:
    spec = spec_run_dir / "ftkit" / "spec.json"
    spec.write_text(json.dumps({**json.loads(spec.read_text()), "command": ["python", "train.py"]}))
    said, out = _run_rank(SCRIPT_RANK, spec_run_dir)
    assert said.get("mlflow imported with deepspeed") == "False", out
    assert said.get("autotuner has mlflow") == "False", out
    assert said.get("mlflow importable after") == "True", out
