"""ftkit import (issue 26): existing DeepSpeed/Accelerate/TrainingArguments/Axolotl/LLaMA-Factory configs in, one
recipe out, every source key reported; ftkit check --against; the recipe fields that keep explicit values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftkit.plan.load import load_and_plan
from ftkit.render.deepspeed import render_deepspeed
from tests.helpers.paths import FIXTURES

# ---------------------------------------------------------------------------------------------------------------
# Recipe fields that keep a source's explicit values (default auto: ftkit's rule, byte-identical to before)


def test_explicit_zero_fields_are_rendered(write_recipe):
    p = write_recipe()
    cfg = render_deepspeed(
        load_and_plan(
            str(p),
            [
                "zero.stage=3",
                "zero.offload_optimizer=cpu",
                "zero.sub_group_size=0",
                "zero.prefetch_bucket_size=123",
                "zero.param_persistence_threshold=0",
                "zero.max_live_parameters=0",
                "zero.max_reuse_distance=5",
                "zero.contiguous_gradients=false",
                "zero.pin_memory=false",
            ],
        )
    )
    z = cfg["zero_optimization"]
    assert (z["sub_group_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (
        0,
        123,
        0,
    )
    assert (z["stage3_max_live_parameters"], z["stage3_max_reuse_distance"]) == (0, 5)
    assert z["contiguous_gradients"] is False and z["offload_optimizer"]["pin_memory"] is False


def test_explicit_stage2_fields_and_fp16_loss_scaling(write_recipe):
    p = write_recipe()
    plan = load_and_plan(
        str(p),
        [
            "zero.stage=2",
            "zero.round_robin_gradients=true",
            "train.precision=fp16",
            "train.fp16_initial_scale_power=32",
            "train.fp16_hysteresis=4",
        ],
    )
    cfg = render_deepspeed(plan)
    assert cfg["zero_optimization"]["round_robin_gradients"] is True
    assert cfg["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 32,
        "hysteresis": 4,
        "min_loss_scale": 1,
    }
    assert (
        "recipe.yaml" not in plan.knobs["fp16.hysteresis"].why
        and "fp16_hysteresis" in plan.knobs["fp16.hysteresis"].why
    )


def test_auto_fields_keep_the_rules(write_recipe):
    p = write_recipe()
    cfg = render_deepspeed(load_and_plan(str(p), ["zero.stage=3", "train.precision=fp16"]))
    z = cfg["zero_optimization"]
    assert (z["sub_group_size"], z["stage3_max_live_parameters"], z["stage3_prefetch_bucket_size"]) == (
        10**9,
        10**9,
        int(0.9 * 64 * 64),
    )
    assert json.dumps(cfg["fp16"]) == (
        '{"enabled": true, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, '
        '"hysteresis": 2, "min_loss_scale": 1}'
    )


@pytest.mark.parametrize("value", ["-1", "true", "1.5"])
def test_explicit_fields_are_validated(write_recipe, value):
    from ftkit.errors import RecipeError

    with pytest.raises(RecipeError) as e:
        load_and_plan(str(write_recipe()), [f"zero.sub_group_size={value}"])
    assert e.value.lines()[0].startswith("command line zero.sub_group_size:")


# ---------------------------------------------------------------------------------------------------------------
# ftkit import: fixtures modelled on the public example configs (Axolotl deepspeed_configs/, LLaMA-Factory
# examples/deepspeed/ and examples/accelerate/, transformers tests/deepspeed/, accelerate's templates)

FIX = FIXTURES / "import"


@pytest.fixture
def here(monkeypatch):
    """Run from the fixtures directory, as a team runs ftkit import from its repository root."""
    monkeypatch.chdir(FIX)
    return FIX


def _cli(*args: str):
    from click.testing import CliRunner

    from ftkit.cli.main import cli

    result = CliRunner().invoke(cli, list(args), catch_exceptions=True)
    assert not (result.exception and not isinstance(result.exception, SystemExit)), result.output
    return result


def _import(tmp_path: Path, model_dir: Path, *sources: str, accept: str = "", **kw):
    from ftkit.imports import import_configs

    out = tmp_path / "recipe.yaml"
    result = import_configs(list(sources), model=str(model_dir), accept=[accept] if accept else [], out=out, **kw)
    out.write_text(result.recipe_text)
    return result, out


def _not_carried(result) -> set[str]:
    """Source keys the report names as not carried (no effect, accepted refusals)."""
    from ftkit.imports.mapping import NO_EFFECT, REFUSED

    return {c.key.removesuffix(" (absent)") for c in result.report.claims if c.status in (NO_EFFECT, REFUSED)}


def _named(key: str, names: set[str]) -> bool:
    return (
        any(key == n or key.startswith(n + ".") or n.startswith(key + ".") for n in names)
        or any(
            key.split(".")[0] == n.split(".")[0] for n in names if n.split(".")[0] in ("scheduler", "tensor_parallel")
        )
        or any(key.split(".")[0] == n for n in names)
    )


# (fixture, --accept, what it is modelled on)
ROUND_TRIPS = [
    ("ds_z0.json", "", "LLaMA-Factory ds_z0_config: stage 0, bucket sizes as 5e8, fp16 loss-scale block, monitors"),
    ("ds_z1_compile.json", "", "Axolotl zero1_torch_compile: compile block, initial_scale_power 32"),
    ("ds_z1_optimizer_auto.json", "", "Axolotl zero1: AdamW block of autos"),
    ("ds_z1_timers.json", "", "LLaMA-Factory z1 (gaudi): contiguous_gradients false, round_robin, timers"),
    ("ds_z2_offload.json", "", "transformers ds_config_zero2: offload, 2e8 buckets, WarmupLR autos"),
    ("ds_z2_offload_rr.json", "", "LLaMA-Factory ds_z2_offload: round_robin_gradients, pin_memory"),
    ("ds_z2_torch_adam.json", "", "accelerate zero_stage2: torch_adam, adam_w_mode, WarmupDecayLR"),
    ("ds_z2_autotp.json", "", "LLaMA-Factory ds_z2_autotp: AutoTP (parallel.tp 2), a _comment key"),
    ("ds_z3.json", "", "Axolotl zero3: sub_group_size 0, live/reuse 0, auto buckets"),
    ("ds_z3_offload_all.json", "", "Axolotl zero3_bf16_cpuoffload_all: unprefixed aliases, force_ds_cpu_optimizer"),
    ("ds_z3_partial_offload.json", "", "LLaMA-Factory ds_z3_partial_offload: pin_memory false, 1e9 limits"),
    ("ds_z3_offload_auto_gather.json", "", 'accelerate zero_stage3_offload: a boolean "auto"'),
    ("ds_warmuplr_linear.json", "", "DeepSpeed docs: WarmupLR, linear warm-up from a floor, concrete values"),
    ("ds_warmupdecaylr_log.json", "", "WarmupDecayLR, log warm-up (DeepSpeed's default) from 1e-4, autos"),
    ("ds_warmupcosinelr.json", "", "WarmupCosineLR: warmup_min_ratio, cos_min_ratio, linear warm-up"),
    ("ds_onecycle.json", "", "DeepSpeed's OneCycle tutorial: stairs, decay, momentum cycling"),
    ("ds_lrrangetest.json", "", "DeepSpeed's LR range test tutorial: staircase"),
    ("ds_z2_monitors.json", "", "autotuning, flops profiler, comms logger, tensorboard/wandb/csv monitors"),
    ("ds_z3_ulysses.json", "", "LLaMA-Factory ds_z3_alst: Ulysses (parallel.sp 4), bf16 loss keys"),
    ("ds_alst.json", "", "DeepSpeed's ALST tutorial: sequence_parallel_size 2 at ZeRO-3"),
]


@pytest.mark.parametrize("fixture,accept,about", ROUND_TRIPS, ids=[r[0] for r in ROUND_TRIPS])
def test_deepspeed_fixture_round_trips(here, tmp_path, model_dir, fixture, accept, about):
    """Import, render, compare by meaning: every difference is a key the report names as not carried."""
    from ftkit.imports import diff_against

    result, out = _import(tmp_path, model_dir, fixture, accept=accept)
    diffs, _ = diff_against(load_and_plan(str(out), []), fixture)
    names = _not_carried(result)
    unexplained = [d.line(fixture) for d in diffs if not _named(d.key, names)]
    assert unexplained == [], about
    keys = {c.key.removesuffix(" (absent)") for c in result.report.claims if c.source == fixture}
    leaves = set(_leaves(json.loads((FIX / fixture).read_text())))
    uncovered = [leaf for leaf in leaves if not any(leaf == k or leaf.startswith(k + ".") for k in keys)]
    assert uncovered == [], "every source key is in the report"


def _leaves(cfg: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        out += _leaves(v, key + ".") if isinstance(v, dict) and v else [key]
    return out


def test_explicit_values_stay_explicit(here, tmp_path, model_dir):
    """A hard-coded bucket size is kept, not replaced by ftkit's hidden-size rule; "auto" stays ftkit's auto."""
    import yaml

    _, out = _import(tmp_path, model_dir, "ds_z2_offload.json")
    zero = yaml.safe_load(out.read_text())["zero"]
    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == (200_000_000, 200_000_000)
    _, out = _import(tmp_path, model_dir, "ds_z3.json")
    zero = yaml.safe_load(out.read_text())["zero"]
    assert zero["reduce_bucket_size"] == "auto" and zero["prefetch_bucket_size"] == "auto"
    assert (zero["sub_group_size"], zero["max_live_parameters"], zero["max_reuse_distance"]) == (0, 0, 0)
    cfg = render_deepspeed(load_and_plan(str(out), []))["zero_optimization"]
    assert cfg["reduce_bucket_size"] == 64 * 64 and cfg["stage3_param_persistence_threshold"] == 640


def test_aliases_and_deprecated_spellings_normalised(here, tmp_path, model_dir):
    result, out = _import(tmp_path, model_dir, "ds_z3_offload_all.json")
    z = render_deepspeed(load_and_plan(str(out), []))["zero_optimization"]
    assert (z["stage3_max_live_parameters"], z["stage3_max_reuse_distance"]) == (0, 0)
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    src = json.loads((FIX / "ds_z3_concrete.json").read_text())
    src["zero_optimization"]["reduce_bucket_size"] = 5e8
    (tmp_path / "concrete.json").write_text(json.dumps(src))
    result, out = _import(tmp_path, model_dir, str(tmp_path / "concrete.json"))
    line = next(x for x in result.lines if "stage3_gather_fp16_weights_on_model_save" in x)
    assert "deprecated spelling of stage3_gather_16bit_weights_on_model_save" in line
    z = render_deepspeed(load_and_plan(str(out), []))
    assert z["zero_optimization"]["sub_group_size"] == 10**14
    assert z["optimizer"]["params"]["betas"] == [0.8, 0.999] and z["optimizer"]["params"]["weight_decay"] == 3e-7
    assert z["fp16"]["enabled"] is True
    recipe = load_and_plan(str(out), []).recipe
    assert (recipe["train.warmup_steps"], recipe["train.lr_scheduler"]) == (500, "WarmupLR")


REFUSED = [
    ("ds_z3_fp8.json", "ds_z3_fp8.json fp8: fp8 training (Transformer Engine) is not supported by ftkit"),
    (
        "accelerate_fsdp2_cp.yaml",
        "accelerate_fsdp2_cp.yaml:12 parallelism_config.parallelism_config_cp_size: context parallelism (ring "
        "attention) is not supported by ftkit",
    ),
    ("ds_z3_concrete.json", "ds_z3_concrete.json zero_optimization.reduce_bucket_size: must be at least 1; got 0"),
    ("ds_torch_scheduler.json", "ds_torch_scheduler.json scheduler.type: schedule StepLR (DeepSpeed builds other"),
    (
        "accelerate_fsdp_local.yaml",
        "accelerate_fsdp_local.yaml:7 fsdp_config.fsdp_state_dict_type: LOCAL_STATE_DICT: FSDP2 has no local state "
        "dict",
    ),  # fmt: skip
    ("accelerate_fp8.yaml", "accelerate_fp8.yaml:2 mixed_precision: fp8 training is not supported by ftkit"),
    ("accelerate_xpu.yaml", "accelerate_xpu.yaml:1 distributed_type: MULTI_XPU: ftkit runs on CUDA GPUs or CPUs"),
    ("accelerate_multi_node.yaml", "accelerate_multi_node.yaml:7 main_process_ip: '1234' is a placeholder"),
    ("llamafactory_dpo.yaml", "llamafactory_dpo.yaml:2 stage: stage dpo (a preference/reward objective)"),
]


@pytest.mark.parametrize("fixture,line", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_with_one_line_exit_2_nothing_written(here, tmp_path, fixture, line):
    out = tmp_path / "recipe.yaml"
    r = _cli("import", fixture, "-o", str(out))
    assert r.exit_code == 2
    errors = [x for x in r.output.splitlines() if x.startswith("ftkit: error: ")]
    assert any(x.removeprefix("ftkit: error: ").startswith(line) for x in errors), r.output
    assert not out.exists()


def test_accept_carries_on_and_says_what_changes(here, tmp_path, model_dir):
    out = tmp_path / "recipe.yaml"
    key = "parallelism_config.parallelism_config_cp_size"
    r = _cli("import", "accelerate_fsdp2_cp.yaml", "-o", str(out), "--model", str(model_dir), "--accept", key)
    assert r.exit_code == 0, r.output
    assert f"accelerate_fsdp2_cp.yaml:12 {key}: accepted (--accept), not carried: context parallelism" in r.output
    assert f"#   accelerate_fsdp2_cp.yaml {key}: context parallelism (ring attention)" in out.read_text()
    r = _cli("import", "ds_z3.json", "-o", str(tmp_path / "x.yaml"), "--accept", "tensor_paralel")
    assert r.exit_code == 2 and "--accept tensor_paralel: matches no refused key" in r.output


def test_trainer_command_line_and_auto_ds_config_give_hf_batch_triple(here, tmp_path, model_dir):
    """deepspeed --num_gpus 8 --num_nodes 2 ... --per_device_train_batch_size 4 --gradient_accumulation_steps 8 with a
    ds_config of "auto"s: HF computes train_batch_size = world 16 x 4 x 8 = 512."""
    result, out = _import(tmp_path, model_dir, "train_cmd.sh")
    plan = load_and_plan(str(out), [])
    assert (plan.micro_batch_size, plan.grad_accum, plan.world_size, plan.global_batch_size) == (4, 8, 16, 512)
    cfg = render_deepspeed(plan)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (
        512,
        4,
        8,
    )
    r = plan.recipe
    assert (r["train.learning_rate"], r["train.adam_beta2"], r["train.max_grad_norm"]) == (2e-5, 0.95, 0.5)
    assert (r["train.precision"], r["train.max_steps"], r["zero.stage"], r["cluster.num_nodes"]) == ("bf16", 1000, 3, 2)
    assert r["cluster.hostfile"] == str(FIX / "hostfile_2x8")
    assert any(
        x.startswith('ds_z3.json train_batch_size: "auto" -> train.global_batch_size = 512') for x in result.lines
    )


def test_trainer_and_deepspeed_mismatch_is_refused_like_hf(here, tmp_path, model_dir):
    (tmp_path / "ds.json").write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    )
    (tmp_path / "args.json").write_text(json.dumps({"per_device_train_batch_size": 4, "output_dir": "o"}))
    with pytest.raises(Exception) as e:
        _import(tmp_path, model_dir, str(tmp_path / "ds.json"), str(tmp_path / "args.json"))
    assert "train_micro_batch_size_per_gpu: 2 but TrainingArguments per_device_train_batch_size is 4" in str(e.value)


def test_accelerate_follows_its_deepspeed_file_and_gives_the_cluster(here, tmp_path, model_dir):
    result, out = _import(tmp_path, model_dir, "accelerate_ds_file.yaml")
    r = load_and_plan(str(out), []).recipe
    assert (r["cluster.num_nodes"], r["cluster.gpus_per_node"], r["cluster.master_addr"]) == (2, 8, "10.0.0.1")
    assert (r["zero.stage"], r["zero.offload_optimizer"], r["zero.pin_memory"]) == (3, "cpu", False)
    assert any("deepspeed_config_file: read: ds_z3_partial_offload.json" in x for x in result.lines)
    result, out = _import(tmp_path, model_dir, "accelerate_inline.yaml")
    r = load_and_plan(str(out), []).recipe
    assert (r["zero.stage"], r["train.precision"], r["zero.reduce_bucket_size"]) == (2, "bf16", 500_000_000)
    _, out = _import(tmp_path, model_dir, "accelerate_multi_gpu.yaml")
    r = load_and_plan(str(out), []).recipe
    assert (r["zero.stage"], r["train.precision"], r["cluster.num_nodes"], r["cluster.gpus_per_node"]) == (
        0,
        "fp16",
        2,
        8,
    )


def test_accelerate_plugin_fields_next_to_a_config_file_are_refused(tmp_path, model_dir):
    (tmp_path / "ds.json").write_text("{}")
    (tmp_path / "a.yaml").write_text("distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n"
                                     "  deepspeed_config_file: ds.json\n  zero_stage: 3\n")  # fmt: skip
    with pytest.raises(Exception) as e:
        _import(tmp_path, model_dir, str(tmp_path / "a.yaml"))
    assert "deepspeed_config.zero_stage: Accelerate refuses it next to deepspeed_config_file" in str(e.value)
    assert "mixed_precision: Accelerate refuses mixed_precision next to a deepspeed_config_file" in str(e.value)


def test_training_arguments_json(here, tmp_path, model_dir):
    result, out = _import(tmp_path, model_dir, "training_args.json")
    r = load_and_plan(str(out), []).recipe
    assert (r["name"], r["train.micro_batch_size"], r["train.max_steps"], r["train.seed"]) == ("sft-json", 2, 500, 1234)
    assert (r["zero.stage"], r["train.save_total_limit"], r["train.precision"]) == (0, 2, "bf16")
    assert not any("<HUB_TOKEN>" in x for x in result.lines), "secrets are never printed"


def test_axolotl(here, tmp_path, model_dir):
    result, out = _import(tmp_path, model_dir, "axolotl_lora.yml")
    r = load_and_plan(str(out), []).recipe
    assert r.has_peft and (r["peft.r"], r["peft.alpha"]) == (16, 32.0)
    assert r["peft.target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (r["data.train"], r["data.max_seq_len"], r["train.epochs"]) == (str(FIX / "data" / "train.jsonl"), 2048, 1.0)
    assert (r["zero.stage"], r["zero.round_robin_gradients"], r["train.precision"]) == (2, True, "bf16")
    with pytest.raises(Exception) as e:
        _import(tmp_path, model_dir, "axolotl_qlora_packing.yml")
    for key in ("load_in_4bit", "adapter", "datasets", "val_set_size", "sample_packing", "optimizer", "special_tokens"):
        assert "axolotl_qlora_packing.yml" in str(e.value) and f" {key}: " in str(e.value), key
    accept = "load_in_4bit,adapter,datasets,val_set_size,sample_packing,optimizer,special_tokens,warmup_steps"
    result, out = _import(tmp_path, model_dir, "axolotl_qlora_packing.yml", accept=accept)
    r = load_and_plan(str(out), []).recipe
    assert r["peft.target_modules"] == ["all-linear"] and r["data.train"] == str(tmp_path / "data" / "train.jsonl")


def test_llamafactory(here, tmp_path, model_dir):
    accept = "dataset,template,max_samples,warmup_ratio,val_size"
    result, out = _import(tmp_path, model_dir, "llamafactory_lora_ds3.yaml", accept=accept)
    r = load_and_plan(str(out), []).recipe
    assert (r["peft.r"], r["peft.alpha"], r["peft.dropout"], r["peft.target_modules"]) == (8, 16.0, 0.0, ["all-linear"])
    assert (r["data.max_seq_len"], r["data.truncate"], r["model.gradient_checkpointing"]) == (2048, True, True)
    assert (r["zero.stage"], r["train.micro_batch_size"], r["train.epochs"]) == (3, 1, 3.0)
    assert any("disable_gradient_checkpointing (absent): mapped -> model.gradient_checkpointing = true" in x
               for x in result.lines)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Malformed sources: one line, exit 2, no traceback, nothing written


MALFORMED = [
    ("bad.json", '{"zero_optimization": {"stage": 2,}}', "bad.json:1: invalid JSON: Expecting property name"),
    ("bad.yaml", "distributed_type: DEEPSPEED\n  num_processes: [", "bad.yaml:2: invalid YAML"),
    ("dup.json", '{"fp16": {}, "fp16": {}}', "dup.json fp16: duplicate key"),
    (
        "types.json",
        '{"zero_optimization": {"stage": "three"}}',
        "types.json zero_optimization.stage: expected a number, got text 'three'",
    ),
    (
        "bucket.json",
        '{"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}',
        "bucket.json zero_optimization.reduce_bucket_size: expected a number, got text 'big'",
    ),  # fmt: skip
    (
        "betas.json",
        '{"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}',
        "betas.json optimizer.params.betas: expected [beta1, beta2]",
    ),  # fmt: skip
    (
        "unknown.json",
        '{"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5}}',
        "unknown.json zero_optimization.reduce_bucket_sise: unknown DeepSpeed zero_optimization key",
    ),  # fmt: skip
    ("list.json", "[1, 2]", "list.json: a list, not a mapping of settings"),
    ("empty.yaml", "", "empty.yaml: empty"),
    ("what.yaml", "colour: blue\n", "what.yaml: cannot tell which kind of config this is"),
    ("stage9.json", '{"zero_optimization": {"stage": 9}}', "stage9.json zero_optimization.stage: must be 0, 1, 2"),
    (
        "acc.yaml",
        "distributed_type: DEEPSPEED\ndeepspeed_config: [1]\n",
        "acc.yaml:2 deepspeed_config: expected a mapping",
    ),
    ("args.yaml", "per_device_train_batch_size: lots\n", "args.yaml:1 per_device_train_batch_size: expected a number"),
    (  # a traceback (AttributeError) before the importer's values were typed
        "opt.json",
        '{"optimizer": {"type": "Adam", "params": 5}, "zero_optimization": {"stage": 2}}',
        "opt.json optimizer.params: expected a mapping of settings, got number 5",
    ),
    ("latin1.json", b'{"a": "\xe9"}', "latin1.json: not UTF-8 text"),
]


@pytest.mark.parametrize("name,text,line", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_source_one_line_exit_2(tmp_path, monkeypatch, name, text, line):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    r = _cli("import", name, "-o", "recipe.yaml")
    assert r.exit_code == 2, r.output
    errors = [x.removeprefix("ftkit: error: ") for x in r.output.splitlines()]
    assert any(x.startswith(line) for x in errors), r.output
    assert "Traceback" not in r.output and not (tmp_path / "recipe.yaml").exists()


def test_missing_source_directory_and_existing_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "ftkit: error: nope.json: not found" in _cli("import", "nope.json").output
    (tmp_path / "d").mkdir()
    assert "ftkit: error: d: is a directory, expected a config file" in _cli("import", "d").output
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 1}}')
    (tmp_path / "recipe.yaml").write_text("mine")
    r = _cli("import", "ds.json", "-o", "recipe.yaml")
    assert r.exit_code == 2 and "recipe.yaml: already exists; pass --force to overwrite" in r.output
    assert (tmp_path / "recipe.yaml").read_text() == "mine"
    r = _cli("import", "ds.json", "-o", "recipe.yaml", "--force")
    assert r.exit_code == 0 and "wrote recipe.yaml" in r.output and "data.train" in r.output


def test_without_out_the_recipe_goes_to_stdout_and_loads(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ftkit.cli.main import cli
    from ftkit.recipe.load import load_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 1}, "bf16": {"enabled": true}}')
    r = CliRunner(mix_stderr=False).invoke(cli, ["import", "ds.json"]) if _mix_stderr() else None
    if r is None:
        r = CliRunner().invoke(cli, ["import", "ds.json"])
        text = r.stdout
    else:
        text = r.stdout
    assert r.exit_code == 0
    (tmp_path / "r.yaml").write_text(text)
    recipe = load_recipe(tmp_path / "r.yaml")
    assert (recipe["zero.stage"], recipe["train.precision"]) == (1, "bf16")


def _mix_stderr() -> bool:
    import inspect

    from click.testing import CliRunner

    return "mix_stderr" in inspect.signature(CliRunner).parameters


# ---------------------------------------------------------------------------------------------------------------
# ftkit check --against: the drift check for configs ftkit did not write


def test_check_against_finds_a_hand_edit_and_passes_an_equivalent_file(here, tmp_path, model_dir):
    _, out = _import(tmp_path, model_dir, "ds_z2_offload_rr.json")
    ok = _cli("check", str(out), "--against", "ds_z2_offload_rr.json")
    assert ok.exit_code == 0 and "ds_z2_offload_rr.json: equivalent to what the recipe renders" in ok.output
    src = json.loads((FIX / "ds_z2_offload_rr.json").read_text())
    # equivalent: other spellings of the same values, keys reordered, defaults written out, "auto" HF fills the same
    z = src["zero_optimization"]
    z["reduce_bucket_size"] = 500000000
    z["allgather_bucket_size"] = "5e8"
    z["overlap_comm"] = "false"
    src["zero_optimization"] = dict(reversed(list(z.items())))
    src["gradient_clipping"] = 1.0
    src["optimizer"] = {"type": "Adam", "params": {"lr": "auto", "betas": [0.9, 0.999], "adam_w_mode": True}}
    (tmp_path / "same.json").write_text(json.dumps(src))
    ok = _cli("check", str(out), "--against", str(tmp_path / "same.json"))
    assert ok.exit_code == 0, ok.output
    # a hand edit of a training value
    src["zero_optimization"]["reduce_bucket_size"] = 4e8
    src["optimizer"]["params"]["betas"] = [0.9, 0.95]
    src["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    (tmp_path / "edited.json").write_text(json.dumps(src))
    bad = _cli("check", str(out), "--against", str(tmp_path / "edited.json"))
    assert bad.exit_code == 1, bad.output
    lines = bad.output.splitlines()
    assert any("zero_optimization.reduce_bucket_size: 400000000 in" in x and "renders 500000000" in x for x in lines)
    assert any("optimizer.params.betas: [0.9, 0.95] in" in x and "renders [0.9, 0.999]" in x for x in lines)
    assert any("zero_optimization.offload_optimizer.device: not in" in x and 'renders "cpu"' in x for x in lines)
    # "auto" nobody fills, and "auto" that resolves to another value, are differences
    src = json.loads((FIX / "ds_z2_offload_rr.json").read_text())
    src["zero_optimization"]["sub_group_size"] = "auto"
    src["zero_optimization"]["stage"] = 3
    (tmp_path / "auto.json").write_text(json.dumps(src))
    bad = _cli("check", str(out), "--against", str(tmp_path / "auto.json"))
    assert bad.exit_code == 1 and "zero_optimization.stage: 3 in" in bad.output


def test_check_against_an_accelerate_yaml_compares_its_deepspeed_file_too(here, tmp_path, model_dir):
    _, out = _import(tmp_path, model_dir, "accelerate_ds_file.yaml")
    ok = _cli("check", str(out), "--against", "accelerate_ds_file.yaml")
    assert ok.exit_code == 0, ok.output
    bad = _cli("check", str(out), "cluster.num_nodes=1", "cluster.gpus_per_node=4", "--against",
               "accelerate_ds_file.yaml")  # fmt: skip
    assert bad.exit_code == 1 and "num_processes: 16 in accelerate_ds_file.yaml, the recipe renders 4" in bad.output


def test_check_against_an_accelerate_yaml_whose_deepspeed_config_is_not_a_mapping(here, tmp_path, model_dir):
    """A traceback (AttributeError) before the importer's values were typed: now the rest is compared."""
    _, out = _import(tmp_path, model_dir, "ds_z3.json")
    acc = tmp_path / "acc.yaml"
    acc.write_text("distributed_type: DEEPSPEED\ndeepspeed_config: nonsense\nnum_processes: 4\n")
    r = _cli("check", str(out), "--against", str(acc))
    assert r.exit_code in (0, 1) and "Traceback" not in r.output, r.output


def test_check_against_refuses_other_kinds_in_one_line(here, tmp_path, model_dir):
    _, out = _import(tmp_path, model_dir, "ds_z3.json")
    r = _cli("check", str(out), "--against", "training_args.json")
    assert (
        r.exit_code == 2 and "training_args.json: is a trainer config: --against compares a DeepSpeed JSON" in r.output
    )


# ---------------------------------------------------------------------------------------------------------------
# The controller stays import-light


@pytest.mark.parametrize("command", ["import", "import-absent-clipping", "import-plan", "check", "check-fsdp"])
def test_import_and_check_against_import_no_heavy_stack(here, tmp_path, model_dir, command):
    import subprocess
    import sys

    heavy = ("torch", "deepspeed", "transformers", "accelerate", "peft")
    out = tmp_path / "recipe.yaml"
    if command == "check":
        _import(tmp_path, model_dir, "ds_z3.json")
        argv = ["check", str(out), "--against", "ds_z3.json"]
    elif command == "check-fsdp":
        _import(tmp_path, model_dir, "accelerate_config_fsdp1.yaml")
        argv = ["check", str(out), "--against", "accelerate_config_fsdp1.yaml"]
    elif command == "import":
        argv = ["import", "train_cmd.sh", "-o", str(out), "--model", str(model_dir)]
    elif command == "import-plan":  # the planner too, on an FSDP source
        argv = ["import", "accelerate_fsdp1_hybrid.yaml", "-o", str(out), "--model", str(model_dir), "--plan"]
    else:  # DeepSpeed's default clipping is read from the installed package's source, not imported
        argv = ["import", "ds_z1_optimizer_auto.json", "-o", str(out), "--model", str(model_dir)]
    probe = (
        "import sys\nfrom ftkit.cli.main import cli\ntry:\n    cli(sys.argv[1:], standalone_mode=False)\n"
        "except SystemExit:\n    pass\n"
        f"print('HEAVY=' + ','.join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
    assert "HEAVY=\n" in r.stderr + "\n" and "HEAVY=," not in r.stderr, r.stderr[-2000:]
    assert [x for x in r.stderr.splitlines() if x.startswith("HEAVY=")] == ["HEAVY="], r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed treats the rendered config as it treats the source (with HF's own "auto" filling): heavy, in make test


def _hf_filled(source: dict, plan, tmp_path: Path, num_training_steps: int = 100) -> dict:
    """The source config after HF Trainer's own "auto" filling, with the TrainingArguments ftkit builds."""
    import copy
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    from ftkit.run.make_spec import training_arguments

    ta = {
        "fp16_full_eval": False,
        "bf16_full_eval": False,
        "save_on_each_node": False,
        "world_size": plan.world_size,
        **training_arguments(plan, str(tmp_path / "run"), "ds_config.json"),
    }
    args = SimpleNamespace(**ta, get_warmup_steps=lambda n: int(ta["warmup_steps"]))
    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(source))
    try:
        hf.trainer_config_process(args)
        model = SimpleNamespace(config=SimpleNamespace(hidden_size=plan.hidden_size))
        hf.trainer_config_finalize(args, model, num_training_steps)  # raises on a value that mismatches TA
        return hf.config
    finally:
        unset_hf_deepspeed_config()


# DeepSpeed's Adam/AdamW defaults for parameters a block leaves out; torch_adam picks the implementation only
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "adam_w_mode": True}


def _as_deepspeed_sees_it(cfg: dict, world: int, monkeypatch) -> dict:
    import deepspeed.runtime.config as dsc

    monkeypatch.setattr(dsc.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(dsc.dist, "get_world_size", lambda *a, **k: world)
    # named in the report; sequence_parallel_size: DeepSpeed then counts world / sp data-parallel ranks, which HF's
    # train_batch_size (world x micro x accumulation) does not: the batch is compared as HF fills it
    not_carried = ("scheduler", "tensor_parallel", "sequence_parallel", "sequence_parallel_size", "compile")
    cfg = {k: v for k, v in cfg.items() if k not in not_carried}
    if isinstance(cfg.get("bf16"), dict):  # loss-scale keys in the bf16 block: named in the report
        cfg["bf16"] = {"enabled": cfg["bf16"].get("enabled", False)}
    ds = dsc.DeepSpeedConfig(cfg)
    zc = ds.zero_config
    seen = {
        "batch": (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps),
        "clipping": ds.gradient_clipping,
        "fp16": ds.float16_config.enabled,
        "bf16": ds.bfloat16_config.enabled,
        "stage": ds.zero_optimization_stage,
        "optimizer": (
            _adamw(ds.optimizer_name, ds.optimizer_params),
            {**ADAMW_DEFAULTS, **(ds.optimizer_params or {})},
        ),
    }
    if ds.float16_config.enabled:
        seen["loss scaling"] = (ds.float16_config.loss_scale, ds.float16_config.initial_scale_power,
                                ds.float16_config.loss_scale_window, ds.float16_config.hysteresis,
                                ds.float16_config.min_loss_scale)  # fmt: skip
    if ds.zero_optimization_stage:
        names = ["contiguous_gradients", "overlap_comm", "reduce_bucket_size"]
        if ds.zero_optimization_stage < 3:
            names += ["allgather_bucket_size", "round_robin_gradients"]
        else:
            names += ["sub_group_size", "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                      "max_reuse_distance"]  # fmt: skip
        seen.update({n: getattr(zc, n) for n in names})
        for block in ("offload_optimizer", "offload_param"):
            b = getattr(zc, block)
            device = str(getattr(b.device, "value", b.device)) if b is not None else "none"
            seen[block] = (device, b.pin_memory if device != "none" else None)
    return seen


def _adamw(name: str | None, params: dict | None) -> str | None:
    """DeepSpeed's Adam with adam_w_mode (its default) is its AdamW."""
    mode = (params or {}).get("adam_w_mode", True)
    return "adamw" if name == "adam" and mode is not False else name


HEAVY_CASES = [(f, a, f) for f, a, _ in ROUND_TRIPS] + [
    ("train_cmd.sh", "", "ds_z3.json"),
    ("torchrun_cmd.txt", "warmup_ratio", "ds_z2_offload_rr.json"),
    ("axolotl_lora.yml", "", "ds_z2_offload_rr.json"),
    ("accelerate_ds_file.yaml", "", "ds_z3_partial_offload.json"),
]


@pytest.mark.heavy
@pytest.mark.parametrize("source,accept,ds_file", HEAVY_CASES, ids=[c[0] for c in HEAVY_CASES])
def test_deepspeed_reads_source_and_rendered_config_alike(here, tmp_path, model_dir, monkeypatch, source, accept,
                                                          ds_file):  # fmt: skip
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    _, out = _import(tmp_path, model_dir, source, accept=accept)
    plan = load_and_plan(str(out), [])
    steps = plan.recipe.train.max_steps or 100  # HF checks a concrete total_num_steps against the run's steps
    filled = _hf_filled(json.loads((FIX / ds_file).read_text()), plan, tmp_path, steps)
    rendered = render_deepspeed(plan)
    source_seen = _as_deepspeed_sees_it(filled, plan.world_size, monkeypatch)
    rendered_seen = _as_deepspeed_sees_it(rendered, plan.world_size, monkeypatch)
    if "optimizer" not in filled:  # HF builds torch AdamW from TrainingArguments: the same values
        source_seen["optimizer"] = rendered_seen["optimizer"]
    for seen in (source_seen, rendered_seen):  # the implementation: the same update up to rounding
        seen["optimizer"][1].pop("torch_adam", None)
        seen["optimizer"][1].pop("fused", None)  # the implementation, like torch_adam
    assert source_seen == rendered_seen


def test_sources_combine_accelerate_deepspeed_and_trainer_arguments(here, tmp_path, model_dir):
    """accelerate.yaml (2 processes) + the ds_config it names (AdamW of autos, stage 1) + TrainingArguments."""
    result, out = _import(tmp_path, model_dir, "accelerate_template_ds.yaml", "trainer_args.yaml")
    plan = load_and_plan(str(out), [])
    r = plan.recipe
    assert (plan.micro_batch_size, plan.grad_accum, plan.world_size, plan.global_batch_size) == (2, 4, 2, 16)
    assert (r["zero.stage"], r["train.precision"], r["train.learning_rate"], r["train.weight_decay"]) == (
        1,
        "bf16",
        1e-5,
        0.01,
    )
    assert (r["train.lr_scheduler"], r["train.max_steps"], r["train.seed"]) == ("constant_with_warmup", 200, 7)
    assert any(
        x.startswith('ds_z1_optimizer_auto.json optimizer.params.lr: "auto" -> train.learning_rate = 1e-05 (HF fills '
                     "it from trainer_args.yaml learning_rate)")
        for x in result.lines
    ), result.lines  # fmt: skip
    # a hostfile gives the cluster; it must agree with what the sources say
    with pytest.raises(Exception) as e:
        _import(tmp_path, model_dir, "accelerate_template_ds.yaml", "trainer_args.yaml", hostfile="hostfile_2x8")
    assert "sources disagree on world size" in str(e.value)
    _, out = _import(tmp_path, model_dir, "ds_z3.json", "trainer_args.yaml", hostfile="hostfile_2x8")
    plan = load_and_plan(str(out), [])
    assert (plan.world_size, plan.num_nodes, plan.global_batch_size) == (16, 2, 2 * 4 * 16)


def test_every_source_key_is_listed_once(here, tmp_path, model_dir):
    import re

    import yaml

    result, _ = _import(tmp_path, model_dir, "axolotl_lora.yml")
    keyed = []
    for line in result.lines:
        m = re.match(r"(\S+?)(?::\d+)? (.+?): ", line)
        if m and not line.startswith("("):
            keyed.append((m.group(1), m.group(2)))
    assert len(keyed) == len(set(keyed)), "one line per source key"
    listed = {key for source, key in keyed if source == "axolotl_lora.yml"}
    assert set(yaml.safe_load((FIX / "axolotl_lora.yml").read_text())) <= listed


def test_readme_import_commands_run(tmp_path, monkeypatch):
    """The sh block with ftkit import (docs/configs.md) runs as written after the README's tour (init, render)."""
    import shlex

    from ftkit.cli.main import cli
    from tests.helpers.readme import sh_blocks
    from tests.helpers.recipes import TINY_LLAMA

    block = next(b for _, b in sh_blocks() if "ftkit import" in b)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myjob" / "model").mkdir(parents=True)
    (tmp_path / "myjob" / "model" / "config.json").write_text(json.dumps(TINY_LLAMA))
    from click.testing import CliRunner

    for args in (["init", "myjob", "--template", "cpu-demo", "--force"], ["render", "myjob/recipe.yaml"]):
        assert CliRunner().invoke(cli, args).exit_code == 0
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert any(c.startswith("ftkit check") and "--against" in c for c in commands)
    for command in commands:
        r = CliRunner().invoke(cli, shlex.split(command)[1:])
        assert r.exit_code == 0, f"{command}\n{r.output}"


COMMANDS = [
    (
        "FORCE_TORCHRUN=1 NNODES=2 NPROC_PER_NODE=8 llamafactory-cli train llamafactory_lora_ds3.yaml",
        "dataset,template,max_samples,warmup_ratio,val_size",
        (1, 2, 16),
    ),  # fmt: skip
    ("accelerate launch --num_processes 4 -m axolotl.cli.train axolotl_lora.yml", "", (2, 2, 4)),
    (
        "python -m torch.distributed.run --nproc-per-node 2 train.py --deepspeed ds_z1_timers.json \\\n"
        "    --per_device_train_batch_size 3",
        "",
        (3, 1, 2),
    ),  # fmt: skip
    ("python train.py --per_device_train_batch_size 2 --deepspeed=ds_z0.json", "", (2, 1, 1)),
    (
        "accelerate launch --config_file accelerate_template_ds.yaml train.py --per_device_train_batch_size 2 "
        "--gradient_accumulation_steps 4",
        "",
        (2, 4, 2),
    ),  # fmt: skip
]


@pytest.mark.parametrize("command,accept,triple", COMMANDS, ids=[c[0].split(" train")[0][:40] for c in COMMANDS])
def test_saved_command_lines_give_the_world_size(here, tmp_path, model_dir, command, accept, triple):
    (tmp_path / "run.sh").write_text(f"#!/bin/bash\nset -e\nexport WANDB_MODE=offline\n{command}\n")
    result, out = _import(tmp_path, model_dir, str(tmp_path / "run.sh"), accept=accept)
    overrides = ["cluster.master_addr=10.0.0.1"] if "cluster.master_addr" in result.placeholders else []
    plan = load_and_plan(str(out), overrides)
    assert (plan.micro_batch_size, plan.grad_accum, plan.world_size) == triple
