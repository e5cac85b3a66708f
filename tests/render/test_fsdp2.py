"""train.backend fsdp2 from the recipe to the configs and the plan (issue 25, points 1-3 and 6): the fsdp section, the
DeepSpeed-only keys refused with their equivalent, an FSDP accelerate.yaml (fsdp_version 2) that Accelerate's own
launch code turns into an FSDP2 plugin, no ds_config.json, the plan's FSDP2 candidates on ZeRO's memory and traffic
model, and ``ftkit launch``/``ftkit submit`` refusing what is not built yet (FSDP2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ftkit.cli.main import cli
from ftkit.errors import RecipeError
from ftkit.model.shape import decoder_layer_class
from ftkit.plan.candidates import full_table
from ftkit.plan.load import load_and_plan
from ftkit.plan.memory import Candidate, Workload, estimate, fsdp2_candidate
from ftkit.recipe.load import load_recipe
from ftkit.render import ACCELERATE_FILE, DS_FILE, render_files
from tests.helpers.paths import MODEL_CONFIGS
from tests.helpers.recipes import MINIMAL

FSDP2 = ["train.backend=fsdp2"]


def _plan(write_recipe, *overrides: str):
    return load_and_plan(str(write_recipe()), [*FSDP2, *overrides])


def test_fsdp2_renders_one_fsdp_accelerate_yaml_and_no_ds_config(write_recipe, tmp_path: Path) -> None:
    plan = _plan(write_recipe, "model.gradient_checkpointing=true", "fsdp.reshard_after_forward=false")
    files = render_files(plan, tmp_path / "configs")
    assert list(files) == [ACCELERATE_FILE]
    acc = yaml.safe_load(files[ACCELERATE_FILE])
    assert acc["distributed_type"] == "FSDP" and "deepspeed_config" not in acc
    assert acc["mixed_precision"] == "bf16" and acc["num_processes"] == 8
    assert acc["fsdp_config"] == {
        "fsdp_activation_checkpointing": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": False,
        "fsdp_reshard_after_forward": False,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_version": 2,
    }
    assert plan.recipe.cluster.engine == "accelerate"  # FSDP2 runs under accelerate unless the recipe says otherwise
    # every value has its why, for ftkit explain; no DeepSpeed knob is decided for an FSDP2 run
    assert plan.knobs["fsdp_reshard_after_forward"].why == "command line"
    assert (
        plan.knobs["fsdp_transformer_layer_cls_to_wrap"].why == "auto: config.json's architectures (LlamaForCausalLM)"
    )
    assert not [k for k in plan.knobs if k.startswith(("zero", "reduce_bucket", "allgather", "overlap", "stage3"))]

    full = _plan(write_recipe, "fsdp.state_dict_type=full", "fsdp.transformer_layer_cls=A,B", "train.precision=fp32")
    fc = yaml.safe_load(render_files(full, tmp_path)[ACCELERATE_FILE])
    assert fc["mixed_precision"] == "no" and fc["fsdp_config"]["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    assert fc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "A,B"


@pytest.mark.parametrize(
    "override,line",
    [
        ("zero.stage=3", "zero.stage: DeepSpeed's key; under train.backend fsdp2 use fsdp.reshard_after_forward"),
        ("zero.offload_optimizer=cpu", "FSDP2 offloads parameters, gradients and optimizer states together"),
        ("zero.offload_params=cpu", "zero.offload_params: DeepSpeed's key; under train.backend fsdp2 use fsdp.offload"),
        ("zero.nvme_path=/nvme", "FSDP2 has no NVMe offload: remove it"),
        ("zero.reduce_bucket_size=1000", "FSDP2 reduce-scatters per wrapped layer: remove it"),
        ("cluster.engine=deepspeed", "ftkit launches train.backend fsdp2 under accelerate"),
        ("checkpoint.local_dir=/dev/shm/x", "the node-local checkpoint tier knows DeepSpeed's checkpoints only"),
        ("checkpoint.peer_copies=1", "checkpoint.peer_copies: copies the node-local tier, which fsdp2 does not use"),
    ],
)
def test_a_deepspeed_only_key_under_fsdp2_is_refused_with_its_equivalent(write_recipe, override, line) -> None:
    with pytest.raises(RecipeError) as e:
        load_recipe(str(write_recipe()), [*FSDP2, override])
    assert line in str(e.value), str(e.value)


def test_fsdp_keys_under_deepspeed_and_cpu_offload_are_refused(write_recipe) -> None:
    with pytest.raises(RecipeError) as e:
        load_recipe(str(write_recipe()), ["fsdp.reshard_after_forward=false"])
    assert "fsdp.reshard_after_forward: applies to train.backend fsdp2 only" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(str(write_recipe()), [*FSDP2, "cluster.accelerator=cpu", "fsdp.offload_params=true"])
    assert "fsdp.offload_params: needs cuda" in str(e.value)
    assert load_recipe(str(write_recipe()), [*FSDP2, "cluster.engine=torchrun"]).cluster.engine == "torchrun"
    # a full recipe lists every key: one set to its default is no conflict (ftkit import writes such recipes)
    load_recipe(str(write_recipe()), ["fsdp.reshard_after_forward=true", "fsdp.state_dict_type=sharded"])
    load_recipe(
        str(write_recipe()), [*FSDP2, "zero.stage=2", "zero.offload_optimizer=none", "checkpoint.local_dir=auto"]
    )


def test_the_fsdp2_candidates_are_planned_on_zeros_model_of_the_same_sharding(write_recipe) -> None:
    """Resharding after forward: ZeRO-3's memory and traffic; without it: ZeRO-2's peak; offload: ZeRO-3 with both
    offloads. The table lists FSDP2's candidates only, the recipe's marked."""
    plan = _plan(write_recipe, "fsdp.reshard_after_forward=false")
    rep = full_table(plan)
    assert [e.candidate.label for e in rep.choice.estimates] == [
        "FSDP2 (no reshard after forward)",
        "FSDP2",
        "FSDP2 + offload (cpu)",
    ]
    assert rep.selected is not None and rep.selected.candidate == fsdp2_candidate(False, False)
    w: Workload = rep.workload
    for fsdp, zero in (
        ((True, False), Candidate(3)),
        ((False, False), Candidate(2)),
        ((True, True), Candidate(3, "cpu", "cpu")),
    ):
        f, z = estimate(fsdp2_candidate(*fsdp), w), estimate(zero, w)
        # the same 16 bytes per parameter of model states as ZeRO's sharding, held FSDP2's way (fp32 sharded
        # parameters, fp32 gradients, Adam's two states), plus the allowance measured on an H200 (docs/accuracy.md)
        assert f.model_states_bytes >= z.model_states_bytes - 2 * w.shape.total_params
        assert abs(f.total_gb - z.total_gb) < 0.1 * z.total_gb + 4 * w.shape.total_params / 2**30
    # without resharding, every unit's 16-bit parameters stay gathered from forward to backward
    no, yes = estimate(fsdp2_candidate(False, False), w), estimate(fsdp2_candidate(True, False), w)
    assert no.components["largest_layer"] == 2 * w.shape.total_params > yes.components["largest_layer"]
    preds = rep.predictions
    assert preds["FSDP2"].step_time_s >= preds["FSDP2 (no reshard after forward)"].step_time_s
    runner = CliRunner()
    out = runner.invoke(cli, ["plan", str(write_recipe()), *FSDP2], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "this run: FSDP2 (set in the recipe): recipe default" in out.output
    assert "local checkpoint tier: off (train.backend fsdp2" in out.output


def test_launch_and_submit_refuse_fsdp2_under_an_engine_other_than_accelerate(write_recipe, tmp_path: Path) -> None:
    """Only ``accelerate launch`` turns accelerate.yaml into the ranks' FSDP plugin: torchrun and srun would start
    plain data parallel ranks, so they are refused before anything starts."""
    recipe = write_recipe()
    runner = CliRunner()
    for args in (
        ["launch", str(recipe), *FSDP2, "cluster.engine=torchrun"],
        ["submit", str(recipe), *FSDP2, "cluster.engine=slurm", "--dry-run"],
    ):
        out = runner.invoke(cli, args)
        assert out.exit_code == 2, out.output
        assert "under train.backend fsdp2: ftkit launches FSDP2 ranks with accelerate only" in out.output
    assert not (tmp_path / "run").exists()


def test_check_names_a_ds_config_left_from_deepspeed(write_recipe, tmp_path: Path) -> None:
    recipe = write_recipe()
    runner = CliRunner()
    assert runner.invoke(cli, ["render", str(recipe), "-o", str(tmp_path / "c")]).exit_code == 0
    assert (tmp_path / "c" / DS_FILE).is_file()
    assert runner.invoke(cli, ["render", str(recipe), *FSDP2, "-o", str(tmp_path / "c")]).exit_code == 0
    out = runner.invoke(cli, ["check", str(recipe), *FSDP2, "-o", str(tmp_path / "c")])
    assert out.exit_code == 1, out.output
    assert f"{tmp_path / 'c' / DS_FILE}: not used with train.backend fsdp2 (remove it)" in out.output
    assert f"{tmp_path / 'c' / ACCELERATE_FILE}: in sync" in out.output


def test_decoder_layer_class_rule() -> None:
    assert decoder_layer_class({"architectures": ["Qwen3ForCausalLM"]}) == "Qwen3DecoderLayer"
    assert decoder_layer_class({"architectures": ["GPTNeoXForCausalLM"]}) == "GPTNeoXLayer"
    assert decoder_layer_class({"architectures": ["LlavaForConditionalGeneration"]}) is None
    assert decoder_layer_class({}) is None and decoder_layer_class({"architectures": "x"}) is None


@pytest.mark.heavy
def test_the_decoder_layer_class_is_the_models_own_no_split_module() -> None:
    """transformers' own ``_no_split_modules`` (what Accelerate falls back to) names the class for every model family
    the planner knows."""
    import transformers

    for f in sorted(MODEL_CONFIGS.glob("*.json")):
        cfg = json.loads(f.read_text())
        layer = decoder_layer_class(cfg)
        if layer is None:
            assert cfg["architectures"][0].endswith("ForConditionalGeneration"), f.name
            continue
        assert layer in getattr(transformers, cfg["architectures"][0])._no_split_modules, f.name


@pytest.mark.heavy
@pytest.mark.parametrize("reshard,precision", [(True, "bf16"), (False, "fp32")])
def test_accelerate_launch_turns_the_rendered_config_into_an_fsdp2_plugin(
    write_recipe, tmp_path: Path, monkeypatch, reshard, precision
) -> None:
    """What ``accelerate launch --config_file`` does with the file: its parser and checks, the environment it gives
    the ranks, and the FSDP plugin Accelerate builds from that environment in every rank."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    plan = _plan(write_recipe, f"fsdp.reshard_after_forward={str(reshard).lower()}", f"train.precision={precision}")
    path = tmp_path / ACCELERATE_FILE
    path.write_text(render_files(plan, tmp_path)[ACCELERATE_FILE])
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "t.py"]))
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == {"bf16": "bf16"}.get(
        precision, "no"
    )
    for k, v in env.items():
        if k.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(k, v)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is reshard
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert str(plugin.state_dict_type).endswith("SHARDED_STATE_DICT") and plugin.cpu_ram_efficient_loading is True


def test_minimal_recipe_still_renders_deepspeed(write_recipe, tmp_path: Path) -> None:
    """The default backend is unchanged: both files, a DEEPSPEED accelerate.yaml."""
    assert "backend" not in MINIMAL
    files = render_files(load_and_plan(str(write_recipe()), []), tmp_path)
    assert list(files) == [DS_FILE, ACCELERATE_FILE]
    assert yaml.safe_load(files[ACCELERATE_FILE])["distributed_type"] == "DEEPSPEED"


# ------------------------------------------------------------------------------------------------ train.backend auto


def _auto(write_recipe, model_dir: Path, *overrides: str):
    (model_dir / "config.json").write_text((MODEL_CONFIGS / "Llama-3.2-1B.json").read_text())
    return load_and_plan(str(write_recipe()), ["train.backend=auto", *overrides])


def test_auto_picks_fsdp2_without_gradient_accumulation_and_zero1_with_it(write_recipe, model_dir, tmp_path) -> None:
    """Llama-3.2-1B on 8 GPUs over PCIe. One micro-step per optimizer step: FSDP2 without resharding moves the least
    (one all-gather of the parameters and one reduce-scatter of the gradients, against ZeRO-1's all-reduce and the
    gather of the updated partition) and has the lightest hooks. Eight micro-steps: FSDP2 gathers the parameters again
    every micro-step, ZeRO-1 reduces once per step, so ZeRO-1 wins. Each plan is then built for its backend: the
    configs follow."""
    fsdp = _auto(write_recipe, model_dir, "train.global_batch_size=16", "cluster.network=pcie-eth25")
    assert fsdp.recipe.train.backend == "fsdp2" and fsdp.grad_accum == 1
    why = fsdp.knobs["backend"].why
    assert why.startswith("auto: FSDP2 (no reshard after forward) is the fastest predicted that fits"), why
    assert fsdp.knobs["fsdp_reshard_after_forward"].value is False
    files = render_files(fsdp, tmp_path / "a")
    assert list(files) == [ACCELERATE_FILE]
    assert yaml.safe_load(files[ACCELERATE_FILE])["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert fsdp.recipe.cluster.engine == "accelerate"

    zero = _auto(write_recipe, model_dir, "train.global_batch_size=128", "cluster.network=pcie-eth25")
    assert zero.recipe.train.backend == "deepspeed" and zero.grad_accum == 8 and zero.stage == 1
    why = zero.knobs["backend"].why
    assert why.startswith("auto: ZeRO-1 is the fastest predicted that fits"), why
    assert "next, FSDP2 (no reshard after forward):" in why and "slower" in why
    files = render_files(zero, tmp_path / "b")
    assert json.loads(files[DS_FILE])["zero_optimization"]["stage"] == 1
    assert yaml.safe_load(files[ACCELERATE_FILE])["distributed_type"] == "DEEPSPEED"


def test_ftkit_plan_under_auto_shows_both_backends_and_the_choice(write_recipe, model_dir) -> None:
    (model_dir / "config.json").write_text((MODEL_CONFIGS / "Llama-3.2-1B.json").read_text())
    out = CliRunner().invoke(cli, ["plan", str(write_recipe()), "train.backend=auto"])
    assert out.exit_code == 0, out.output
    rows = [line.split("  ")[0] for line in out.output.splitlines()]
    assert {"ZeRO-1", "ZeRO-3", "FSDP2", "FSDP2 (no reshard after forward)"} <= set(rows), rows
    chosen = [line for line in out.output.splitlines() if line.endswith("<- this run")]
    assert len(chosen) == 1 and chosen[0].startswith("FSDP2 (no reshard after forward)"), chosen
    assert "this run: FSDP2 (no reshard after forward) (auto): auto: FSDP2" in out.output
    data = json.loads(CliRunner().invoke(cli, ["plan", str(write_recipe()), "train.backend=auto", "--json"]).output)
    assert data["plan"]["backend"] == "fsdp2"


def test_auto_keeps_what_the_recipe_fixes_and_refuses_what_fsdp2_cannot_run(write_recipe, model_dir) -> None:
    """zero.* and fsdp.* narrow their own side; an engine or a local tier FSDP2 cannot use is refused at once."""
    pinned = _auto(write_recipe, model_dir, "zero.stage=3", "fsdp.reshard_after_forward=true")
    labels = {e.candidate.label for e in pinned.backend_report.choice.estimates}
    # the stage and the resharding fixed, the offloads left open (ZeRO++ needs several nodes)
    assert labels == {"ZeRO-3", "ZeRO-3 + optimizer offload (cpu)", "FSDP2", "FSDP2 + offload (cpu)"}, labels
    assert pinned.recipe.train.backend == "fsdp2"  # per unit, not per tensor: fewer fetches than ZeRO-3's
    for override, message in (
        ("cluster.engine=torchrun", "train.backend auto may choose fsdp2, which ftkit launches under accelerate only"),
        (
            "checkpoint.local_dir=/scratch",
            "knows DeepSpeed's checkpoints only: set it to null under train.backend auto",
        ),
    ):
        with pytest.raises(RecipeError, match=message.replace(".", r"\.")):
            load_recipe(str(write_recipe()), ["train.backend=auto", override])


def test_auto_when_nothing_fits_on_either_backend(write_recipe, model_dir) -> None:
    """``ftkit plan`` still prints both backends' table with what would fit (exit 10); a launch's plan refuses in
    one line naming train.backend."""
    (model_dir / "config.json").write_text((MODEL_CONFIGS / "Meta-Llama-3-70B.json").read_text())
    tiny = ["train.backend=auto", "cluster.gpus_per_node=1", "cluster.gpu_memory_gb=8", "cluster.host_memory_gb=16"]
    out = CliRunner().invoke(cli, ["plan", str(write_recipe()), *tiny, "train.global_batch_size=2"])
    assert out.exit_code == 10, out.output
    assert "FSDP2" in out.output and "ZeRO-1" in out.output and "nothing fits" in out.output
    with pytest.raises(RecipeError, match="train.backend.*auto: nothing fits on either backend"):
        load_and_plan(str(write_recipe()), [*tiny, "train.global_batch_size=2"])
