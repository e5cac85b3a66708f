"""The planner's FSDP2 traffic (ftkit/plan/comm.py: per-unit all-gathers every micro-step, again in backward when
resharding after forward, per-unit reduce-scatters once per optimizer step) against what FSDP2 really calls: two
CPU ranks under HF Trainer with Accelerate's FSDP2 plugin, every all-gather and reduce-scatter counted in one
optimizer step (calls and elements)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO
from tests.helpers.runs import free_port, mp_lock

pytestmark = pytest.mark.slow

_RANK = r"""
import collections, json, os, sys
from pathlib import Path
from ftkit.launch.rank import install_startup
install_startup("cpu", Path(sys.argv[3]), "fsdp2")
import torch, torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
counts = collections.Counter()
def counted(name):
    original = getattr(dist, name)
    def call(*a, **k):
        tensors = [x for x in (*a, *k.values()) if isinstance(x, torch.Tensor)]
        counts[name + ".calls"] += 1
        counts[name + ".numel"] += max(t.numel() for t in tensors)
        return original(*a, **k)
    setattr(dist, name, call)
for name in ("all_gather_single", "reduce_scatter_single"):  # what FSDP2's collectives call
    counted(name)
class Count(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        counts.clear()
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 2 and int(os.environ["RANK"]) == 0:
            Path(sys.argv[4]).write_text(json.dumps(counts))
ga = int(sys.argv[2])
args = TrainingArguments(output_dir=sys.argv[3] + "/out", per_device_train_batch_size=2, gradient_accumulation_steps=ga,
    max_steps=2, use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no", disable_tqdm=True)
ids = [[i % 50 + 1] * 32 for i in range(64)]
rows = Dataset.from_dict({"input_ids": ids, "labels": ids})
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
Trainer(model=model, args=args, train_dataset=rows, callbacks=[Count()]).train()
# torch's documented shutdown: a script that ends with its gloo group alive can be aborted at interpreter exit, its
# worker threads still holding FSDP2's async work ("terminate called without an active exception", SIGABRT after
# training had finished: a local CI run; pytorch/pytorch#190489)
dist.destroy_process_group()
"""


def _measure(model: Path, tmp_path: Path, reshard: bool, ga: int) -> dict[str, int]:
    out = tmp_path / f"counts-{reshard}-{ga}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            # what `accelerate launch --config_file` sets from ftkit's FSDP accelerate.yaml (tests/render/test_fsdp2.py)
            "ACCELERATE_USE_FSDP": "true",
            "FSDP_VERSION": "2",
            "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
            "FSDP_RESHARD_AFTER_FORWARD": str(reshard).lower(),
            "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        }
    )
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    argv += [str(script), str(model), str(ga), str(tmp_path), str(out)]
    with mp_lock():
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("reshard", "ga"), [(True, 2), (False, 1)])
def test_fsdp2_collectives_per_step_equal_the_plan(fx, tmp_path, reshard, ga) -> None:
    from ftkit.model.shape import count_params
    from ftkit.plan.comm import traffic
    from ftkit.plan.memory import Workload, fsdp2_candidate

    measured = _measure(fx["model"], tmp_path, reshard, ga)
    shape = count_params(json.loads((fx["model"] / "config.json").read_text()))
    w = Workload(shape=shape, world_size=2, gpus_per_node=2, micro_batch_size=2, seq_len=32, precision="fp32")
    t = traffic(fsdp2_candidate(reshard, False), w, ga)
    gathers = [c for c in t.collectives if c.op == "all_gather_into_tensor"]
    scatters = [c for c in t.collectives if c.op == "reduce_scatter_tensor"]
    # the logger's unit is one rank's input (bytes); the counts are the gathered output's elements
    predicted = {
        "all_gather_single.calls": sum(c.calls for c in gathers),
        "all_gather_single.numel": sum(c.logger_bytes for c in gathers) // 4 * 2,
        "reduce_scatter_single.calls": sum(c.calls for c in scatters),
        "reduce_scatter_single.numel": sum(c.logger_bytes for c in scatters) // 4,
    }
    assert measured == predicted, (measured, predicted)
