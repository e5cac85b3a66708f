"""FSDP2 on CPU ranks, for real: Accelerate asked for FSDP2 (the environment ``accelerate launch`` sets from an
FSDP config) on a CPU process runs plain DDP and says nothing; with the rank start-up ftkit installs, the model is
sharded (DTensor parameters), and the proof every rank runs tells the two apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.errors import FsdpNotOn
from ftkit.launch.rank import fsdp2_proof
from tests.helpers.paths import REPO
from tests.helpers.runs import free_port

_PREPARE = r"""
import json, sys
from pathlib import Path
if sys.argv[1] == "ftkit":
    from ftkit.launch.rank import install_startup
    install_startup("cpu", Path(sys.argv[3]), "fsdp2")
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM
from ftkit.errors import FsdpNotOn
from ftkit.launch.rank import fsdp2_proof
accelerator = Accelerator(cpu=True)
model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
try:
    out = {"proof": fsdp2_proof(model)}
except FsdpNotOn as e:
    out = {"error": str(e)}
print(json.dumps({"type": accelerator.distributed_type.value, **out}))
"""


def _prepare(start: str, model: Path, tmp_path: Path) -> subprocess.Popen:
    """One process of a 1-rank job preparing a model with Accelerate: started, not waited for (the two starts of
    the test import the libraries side by side)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            # what `accelerate launch --config_file` sets from ftkit's FSDP accelerate.yaml (tests/render/test_fsdp2.py)
            "ACCELERATE_USE_FSDP": "true",
            "FSDP_VERSION": "2",
            "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
            "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        }
    )
    argv = [sys.executable, "-c", _PREPARE, start, str(model), str(tmp_path / "batons")]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.heavy
def test_accelerate_falls_back_to_ddp_on_cpu_and_the_rank_start_up_turns_fsdp2_on(tmp_path):
    from ftkit.launch.fixtures import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model")  # 2 decoder layers: 21 parameter tensors
    procs = [_prepare("plain", model_dir, tmp_path), _prepare("ftkit", model_dir, tmp_path)]
    plain, ftkit = (_result(p) for p in procs)
    assert plain["type"] == "MULTI_CPU" and "0 of 21 parameters are DTensors" in plain["error"], plain
    assert "Accelerate fell back to plain data parallel" in plain["error"]
    assert ftkit == {"type": "FSDP", "proof": {"dtensor_params": 21, "params": 21}}, ftkit


@pytest.mark.heavy
def test_the_proof_refuses_a_model_without_dtensors():
    torch = pytest.importorskip("torch")
    with pytest.raises(FsdpNotOn, match="0 of 2 parameters are DTensors; FSDP2 is not on"):
        fsdp2_proof(torch.nn.Linear(2, 2))
    with pytest.raises(FsdpNotOn, match="0 of 0 parameters"):
        fsdp2_proof(None)
