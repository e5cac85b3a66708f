"""The recipe's ``parallel`` section (issue 40): every impossible tensor/sequence-parallel combination is refused
with one line naming the key, the numbers and the fix; a recipe without the section records and hashes as before.

The tiny Llama of the quick tests has 4 attention heads and 2 key-value heads; MINIMAL has 8 ranks per node."""

from __future__ import annotations

import pytest

from ftkit.errors import RecipeError
from ftkit.plan.plan import build_plan
from ftkit.recipe.load import load_recipe
from tests.helpers.cli import run_ftkit


def _problems(path, overrides):
    with pytest.raises(RecipeError) as e:
        build_plan(load_recipe(str(path), overrides), with_memory=False)
    return [str(p) for p in e.value.problems]


# (overrides, the key refused, a phrase of its one line)
IMPOSSIBLE = [
    (
        ["parallel.tp=2", "parallel.sp=2"],
        "parallel.sp",
        "tensor and sequence parallelism together (tp 2 x sp 2) are not supported",
    ),
    (["parallel.sp=2", "train.backend=fsdp2"], "parallel.sp", "it needs train.backend deepspeed (is fsdp2)"),
    (["parallel.tp=2", "zero.stage=3"], "parallel.tp", "runs at ZeRO stage 0-2 (zero.stage is 3"),
    (["parallel.tp=2", "train.backend=auto"], "parallel.tp", "set train.backend deepspeed or fsdp2"),
    (["parallel.sp=3", "data.max_seq_len=513"], "parallel.sp", "sp 3 does not divide cluster.gpus_per_node 8"),
    (["parallel.sp=2", "data.max_seq_len=513"], "parallel.sp", "2 does not divide data.max_seq_len 513"),
    # the plan's rules: the model's heads, the hosts, the engines' meshes
    (["parallel.tp=8", "cluster.gpus_per_node=8"], "parallel.tp", "8 does not divide the model's 4 attention heads"),
    (
        ["parallel.tp=4", "train.backend=fsdp2", "train.global_batch_size=16", "cluster.gpus_per_node=8"],
        "parallel.tp",
        "4 does not divide the model's 2 key-value heads",
    ),
    (["parallel.sp=8"], "parallel.sp", "8 does not divide the model's 4 attention heads"),
    (
        ["parallel.tp=2", "train.backend=fsdp2", "cluster.gpus_per_node=2", "train.global_batch_size=4"],
        "parallel.tp",
        "leaves FSDP2 no ranks to shard over",
    ),
    (
        ["parallel.sp=2", "train.global_batch_size=12", "cluster.gpus_per_node=8", "train.micro_batch_size=2"],
        "train.global_batch_size",
        "12 is not divisible by micro_batch_size 2 x data-parallel degree 4 (world size 8 / sp 2) = 8",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "phrase"), IMPOSSIBLE, ids=[" ".join(o) for o, _, _ in IMPOSSIBLE])
def test_every_impossible_combination_is_one_line(write_recipe, overrides, key, phrase):
    problems = _problems(write_recipe(), overrides)
    hits = [p for p in problems if f" {key}: " in p and phrase in p]
    assert hits, problems
    assert all("\n" not in p for p in problems)


def test_sp_refuses_eager_attention(write_recipe, model_dir):
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "_attn_implementation": "eager"}))
    problems = _problems(write_recipe(), ["parallel.sp=2", "cluster.gpus_per_node=2", "train.global_batch_size=4"])
    assert any("parallel.sp: Ulysses sequence parallelism cannot use eager attention" in p for p in problems)


def test_hostfile_slots_must_hold_whole_groups(write_recipe, tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=6\n")
    hostfile = f"cluster.hostfile={tmp_path / 'hosts'}"
    problems = _problems(write_recipe(), ["parallel.sp=4", hostfile, "train.global_batch_size=24"])
    assert any("parallel.sp: sp 4 does not divide the 6 processes of a host" in p for p in problems), problems


def test_the_cli_says_it_in_one_line_with_exit_2(write_recipe, tmp_path):
    path = write_recipe()
    res = run_ftkit("render", str(path), "parallel.tp=2", "parallel.sp=2", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "parallel.sp: tensor and sequence parallelism together" in lines[0], lines


def test_valid_layouts_set_the_data_parallel_degree(write_recipe):
    plan = build_plan(load_recipe(str(write_recipe()), ["parallel.sp=2"]), with_memory=False)
    assert (plan.tp, plan.sp, plan.dp_size, plan.world_size) == (1, 2, 4, 8)
    assert plan.grad_accum == 16 // (2 * 4)  # global = micro x accumulation x DP degree, not world size
    assert plan.knobs["data_parallel_size"].value == 4
    plan = build_plan(load_recipe(str(write_recipe()), ["parallel.tp=2", "cluster.gpus_per_node=2"]), with_memory=False)
    assert (plan.tp, plan.dp_size, plan.grad_accum) == (2, 1, 8)


def test_without_the_section_the_record_and_hash_are_unchanged(write_recipe):
    path = write_recipe()
    plain = load_recipe(str(path))
    assert "parallel" not in plain.to_dict()
    ones = load_recipe(str(path), ["parallel.tp=1", "parallel.sp=1"])
    assert ones.hash() == plain.hash()
    sp = load_recipe(str(path), ["parallel.sp=2"])
    assert sp.to_dict()["parallel"] == {"tp": 1, "sp": 2} and sp.hash() != plain.hash()
    assert sp.parallel.sp == 2 and sp.parallel.tp == 1


def test_auto_degrees_are_accepted_by_the_loader(write_recipe):
    r = load_recipe(str(write_recipe()), ["parallel.tp=auto", "parallel.sp=auto", "train.backend=fsdp2"])
    assert r.parallel.tp == "auto" and r.parallel.sp == "auto"


def test_degrees_below_one_are_refused(write_recipe):
    with pytest.raises(RecipeError) as e:
        load_recipe(str(write_recipe()), ["parallel.tp=0"])
    assert "parallel.tp" in str(e.value.problems[0])


def test_launch_runs_autotp_and_the_built_in_entry_s_sp_and_refuses_the_rest_in_one_line(write_recipe, tmp_path):
    """Issue 40 point 4: TP (DeepSpeed AutoTP) and SP (the built-in entry) launch; FSDP2 x TP and SP in a script of
    the user's own are refused before anything starts (the old code refused every TP/SP layout)."""
    recipe = str(write_recipe())
    for layout in ("parallel.sp=2", "parallel.tp=2"):
        res = run_ftkit("launch", recipe, layout, "--dry-run", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
    res = run_ftkit("launch", recipe, "parallel.tp=2", "train.backend=fsdp2", "--dry-run", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "parallel.tp: tp 2 under train.backend fsdp2: ftkit launch runs tensor parallelism through" in res.stderr
    res = run_ftkit("launch", recipe, "parallel.sp=2", "--dry-run", "--", "python", "train.py", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "parallel.sp: sp 2 with a script of your own: ftkit launch runs sequence parallelism with" in res.stderr
