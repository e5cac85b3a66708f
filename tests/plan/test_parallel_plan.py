"""Tensor and sequence parallelism in the plan (issue 40): memory per GPU with activations divided by SP (and the
sharded part by TP), TP's all-reduces and SP's all-to-alls on the intra-node links, ``auto`` choosing a layout only
when data parallelism alone does not fit or is slower, and the longest sequence each layout fits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ftkit.model.shape import count_params
from ftkit.plan.comm import parallel_collectives, traffic
from ftkit.plan.memory import Candidate, Workload, estimate, tp_activation_share
from ftkit.plan.parallel import choose_layout, layout_table, longest_seq
from ftkit.plan.plan import build_plan
from ftkit.plan.types import LayoutRow
from ftkit.recipe.load import load_recipe
from tests.helpers.cli import run_ftkit

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
LLAMA8B = json.loads((CONFIGS / "Meta-Llama-3-8B.json").read_text())
SHAPE = count_params(LLAMA8B)
assert SHAPE is not None
W = Workload(shape=SHAPE, world_size=8, gpus_per_node=8, micro_batch_size=1, seq_len=32768, precision="bf16")


def test_sp_divides_the_activations_and_keeps_the_model_states():
    base, sp = estimate(Candidate(2), W), estimate(Candidate(2), dataclasses.replace(W, sp=4))
    assert sp.components["weights"] == base.components["weights"]
    assert sp.components["optimizer_states"] == base.components["optimizer_states"]  # ZeRO shards over every rank
    assert sp.components["activations"] == pytest.approx(base.components["activations"] / 4, rel=0.01)
    assert sp.components["logits"] == pytest.approx(base.components["logits"] / 4, rel=0.01)


def test_tp_divides_the_weights_and_the_sharded_activations():
    base, tp = estimate(Candidate(0), W), estimate(Candidate(0), dataclasses.replace(W, tp=2))
    assert tp.components["weights"] == pytest.approx(base.components["weights"] / 2, rel=1e-6)
    share = tp_activation_share(SHAPE, 2)  # (8h + (16h + 8I)/2) / (24h + 8I) for h 4096, I 14336
    assert share == pytest.approx((8 * 4096 + (16 * 4096 + 8 * 14336) / 2) / (24 * 4096 + 8 * 14336))
    assert tp.components["activations"] == pytest.approx(base.components["activations"] * share, rel=0.01)
    assert tp.components["logits"] == base.components["logits"]  # the lm_head's output is gathered whole


def test_tp_and_sp_traffic_per_optimizer_step():
    w = dataclasses.replace(W, tp=2, seq_len=4096, micro_batch_size=2)
    (ar,) = parallel_collectives(w, grad_accum=3)
    # 2 all-reduces of b·s·h per layer and pass, forward and backward, over 3 micro-steps, bf16
    assert (ar.op, ar.group, ar.scope, ar.calls) == ("all_reduce", 2, "intra", 2 * 32 * 2 * 3)
    assert ar.logger_bytes == ar.calls * 2 * 4096 * 4096 * 2
    w = dataclasses.replace(W, sp=4, seq_len=4096, micro_batch_size=1, gradient_checkpointing=True)
    (a2a,) = parallel_collectives(w, grad_accum=1)
    h_kv = 8 * 128  # 8 key-value heads of 128
    per_layer = 1 * (4096 // 4) * (2 * 4096 + 2 * h_kv) * 2
    assert (a2a.op, a2a.group, a2a.calls) == ("all_to_all_single", 4, 4 * 32 * 3)  # recompute repeats forward's
    assert a2a.logger_bytes == per_layer * 32 * 3
    # the data-parallel side of TP reduces the rank's half of the model over the 4 data-parallel ranks
    t = traffic(Candidate(1), dataclasses.replace(W, tp=2), 1)
    dp = [c for c in t.collectives if c.op == "all_reduce" and c.group == 4]
    assert dp and sum(c.logger_bytes for c in dp) < SHAPE.total_params * 2 / 2 + 1e6


def test_longest_sequence_grows_with_sp():
    c = Candidate(3)
    one = longest_seq(c, W, 80, None)
    four = longest_seq(c, dataclasses.replace(W, sp=4), 80, None)
    assert 0 < one < four and four % (128 * 4) == 0
    assert four > 3 * one  # activations and logits dominate at long sequences


def _row(tp, sp, fits, step):
    return LayoutRow(tp, sp, 8 // (tp * sp), 1, "ZeRO-2", 10.0, fits, step, 1.0, 1024, "r")


def test_auto_keeps_data_parallelism_unless_it_does_not_fit_or_is_clearly_slower():
    chosen, why = choose_layout([_row(1, 1, True, 1.0), _row(1, 2, True, 0.95)])
    assert (chosen.tp, chosen.sp) == (1, 1) and "no layout is 10% faster" in why
    chosen, why = choose_layout([_row(1, 1, True, 1.0), _row(2, 1, True, 0.8)])
    assert (chosen.tp, chosen.sp) == (2, 1) and "20% faster" in why
    chosen, why = choose_layout([_row(1, 1, False, 1.0), _row(1, 2, True, 1.3), _row(1, 4, True, 1.2)])
    assert (chosen.tp, chosen.sp) == (1, 4) and "data parallelism alone does not fit" in why
    assert choose_layout([_row(1, 1, False, 1.0)]) == (None, "no layout fits")


@pytest.fixture
def llama8b(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA8B))
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')

    def write(seq: int, extra: str = "") -> Path:
        p = tmp_path / "r.yaml"
        p.write_text(
            "model: {path: ./m, gradient_checkpointing: true}\n"
            f"data: {{train: ./d.jsonl, max_seq_len: {seq}}}\n"
            "train: {output_dir: ./run, micro_batch_size: 1, global_batch_size: 8}\n"
            "zero: {stage: auto}\n"
            f"parallel: {{sp: auto{extra}}}\n"
            "cluster: {gpus_per_node: 8, gpu_memory_gb: 80}\n"
        )
        return p

    return write


def test_auto_chooses_sp_for_a_sequence_data_parallelism_cannot_fit(llama8b):
    plan = build_plan(load_recipe(str(llama8b(65536))))
    assert plan.sp > 1 and plan.tp == 1
    assert plan.grad_accum == 8 // plan.dp_size  # global = micro x accumulation x DP degree
    dp_only = next(r for r in plan.layouts if r.tp == r.sp == 1)
    assert not dp_only.fits and dp_only.longest_seq < 65536 <= plan.layouts[0].longest_seq
    assert "data parallelism alone does not fit" in plan.knobs["sequence_parallel_size"].why


def test_auto_keeps_data_parallelism_where_it_fits(llama8b):
    plan = build_plan(load_recipe(str(llama8b(4096))))
    assert (plan.tp, plan.sp, plan.dp_size) == (1, 1, 8)
    assert plan.knobs["sequence_parallel_size"].why.startswith("auto: data parallelism alone fits")


def test_a_fixed_layout_is_compared_with_the_others(llama8b, tmp_path):
    path = llama8b(65536)
    plan = build_plan(load_recipe(str(path), ["parallel.sp=2"]), strict=False)
    rows = layout_table(plan)
    assert (rows[0].tp, rows[0].sp) == (1, 2) and {(r.tp, r.sp) for r in rows} >= {(1, 1), (1, 4), (1, 8)}
    res = run_ftkit("plan", str(path), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["plan"]["sp"] > 1 and data["layouts"][0]["layout"].startswith("SP=")
    assert all(row["longest_seq"] % 128 == 0 for row in data["layouts"])
    text = run_ftkit("plan", str(path), cwd=tmp_path).stdout
    assert "longest seq" in text and "<- this run" in text


def test_no_parallel_section_no_layout_table(write_recipe, tmp_path):
    res = run_ftkit("plan", str(write_recipe()), "--json", cwd=tmp_path)
    assert res.returncode in (0, 10), res.stderr
    assert "layouts" not in json.loads(res.stdout)
