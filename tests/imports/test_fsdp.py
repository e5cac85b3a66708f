"""FSDP sources (issue 38): Accelerate FSDP2 configs map key for key to ``train.backend: fsdp2``; FSDP1 configs are
converted the way ``accelerate to-fsdp2`` converts them (Accelerate's own table is the reference) with one report
line per key whose meaning changes; what FSDP2 cannot do is refused with the reason; check --against compares by
meaning; a recipe value that cannot load is refused at the source's line. Axolotl and TrainingArguments FSDP too."""

from __future__ import annotations

import pytest
import yaml

from ftkit.errors import UserError
from ftkit.plan.load import load_and_plan
from ftkit.render.accelerate import accelerate_dict
from tests.imports.helpers import FIX, cli, import_to


@pytest.fixture
def here(monkeypatch):
    monkeypatch.chdir(FIX)
    return FIX


def _recipe(out):
    return load_and_plan(str(out), []).recipe


def test_an_fsdp2_config_maps_key_for_key(here, tmp_path, model_dir):
    result, out = import_to(tmp_path, model_dir, "accelerate_config_fsdp2.yaml")
    r = _recipe(out)
    assert (r["train.backend"], r["cluster.engine"], r["train.precision"]) == ("fsdp2", "accelerate", "bf16")
    got = (r["fsdp.reshard_after_forward"], r["fsdp.offload_params"], r["fsdp.state_dict_type"])
    assert got == (True, False, "sharded")
    assert (r["fsdp.cpu_ram_efficient_loading"], r["fsdp.transformer_layer_cls"]) == (True, "LlamaDecoderLayer")
    assert r["model.gradient_checkpointing"] is False and r["zero.stage"] == 2  # zero.* untouched (defaults)
    assert (r["cluster.num_nodes"], r["cluster.gpus_per_node"]) == (1, 8)


@pytest.mark.parametrize(
    "strategy,reshard,changes",
    [("FULL_SHARD", True, False), ("SHARD_GRAD_OP", False, False), ("HYBRID_SHARD", True, True),
     ("HYBRID_SHARD_ZERO2", False, True), ("NO_SHARD", False, True), ("2", False, False)],
)  # fmt: skip
@pytest.mark.heavy
def test_fsdp1_strategies_convert_like_accelerate_to_fsdp2(tmp_path, model_dir, strategy, reshard, changes):
    """Each strategy's reshard_after_forward is the one ``accelerate to-fsdp2`` writes (read from Accelerate's own
    table); a strategy whose meaning changes says so on its own line."""
    pytest.importorskip("accelerate")
    from accelerate.commands.to_fsdp2 import convert_config_to_fsdp2

    block = {"fsdp_sharding_strategy": strategy, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    config = {"distributed_type": "FSDP", "num_processes": 8, "fsdp_config": block}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(config))
    result, out = import_to(tmp_path, model_dir, str(tmp_path / "a.yaml"))
    assert _recipe(out)["fsdp.reshard_after_forward"] is reshard
    if not strategy.isdigit():  # Accelerate's table reads names; FSDP reads numbers as the enum's value
        converted = convert_config_to_fsdp2(yaml.safe_load(yaml.safe_dump(config)))["fsdp_config"]
        assert converted["fsdp_reshard_after_forward"] is reshard
    line = next(x for x in result.lines if " fsdp_config.fsdp_sharding_strategy:" in x)
    assert ("its meaning changes" in line) is changes, line


def test_fsdp1_keys_fsdp2_drops_get_one_line_each(here, tmp_path, model_dir):
    """backward_prefetch, forward_prefetch, use_orig_params, sync_module_states: removed or not implemented in FSDP2
    (accelerate to-fsdp2 drops them), each reported; a size-based wrap is not carried (ftkit wraps layers)."""
    result, out = import_to(tmp_path, model_dir, "accelerate_fsdp1_hybrid.yaml")
    lines = {x.split(": ", 1)[0].split(" ", 1)[1]: x for x in result.lines if x.startswith("accelerate_fsdp1_hybrid")}
    for key in ("fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states",
                "fsdp_auto_wrap_policy", "fsdp_min_num_params"):  # fmt: skip
        assert "not carried" in lines[f"fsdp_config.{key}"], lines
    assert "HSDP" in lines["fsdp_config.fsdp_sharding_strategy"]
    r = _recipe(out)
    assert (r["cluster.num_nodes"], r["cluster.master_addr"], r["fsdp.state_dict_type"]) == (2, "10.1.0.7", "sharded")


def test_a_strategy_name_in_reshard_after_forward_is_fsdp1s(here, tmp_path, model_dir):
    """What `accelerate config` writes for FSDP1: the strategy in fsdp_reshard_after_forward."""
    result, out = import_to(tmp_path, model_dir, "accelerate_config_fsdp1.yaml")
    r = _recipe(out)
    assert (r["fsdp.reshard_after_forward"], r["model.gradient_checkpointing"]) == (False, True)
    assert any("FSDP1's SHARD_GRAD_OP: FSDP2's reshard_after_forward false" in x for x in result.lines)


def test_left_out_keys_take_accelerates_defaults(tmp_path, model_dir):
    """FSDP1 without a state dict type saves FULL_STATE_DICT (Accelerate's FSDP1 default); no wrap policy is NO_WRAP
    (reported, not carried: ftkit wraps layers)."""
    (tmp_path / "a.yaml").write_text("distributed_type: FSDP\nnum_processes: 8\n")
    result, out = import_to(tmp_path, model_dir, str(tmp_path / "a.yaml"))
    assert _recipe(out)["fsdp.state_dict_type"] == "full"
    assert any("fsdp_config.fsdp_auto_wrap_policy (absent): not carried: Accelerate's default NO_WRAP" in x
               for x in result.lines), result.lines  # fmt: skip


def test_what_fsdp2_cannot_do_is_refused_with_the_reason(here, tmp_path, model_dir):
    r = cli("import", "accelerate_fsdp_local.yaml", "-o", str(tmp_path / "r.yaml"))
    assert r.exit_code == 2 and "FSDP2 has no local state dict" in r.output, r.output
    r = cli("import", "accelerate_fsdp_local.yaml", "-o", str(tmp_path / "r.yaml"), "--model", str(model_dir),
            "--accept", "fsdp_config.fsdp_state_dict_type")  # fmt: skip
    assert r.exit_code == 0 and _recipe(tmp_path / "r.yaml")["fsdp.state_dict_type"] == "sharded", r.output


@pytest.mark.parametrize(
    "old,new,key,says",
    [
        ("fsdp_offload_params: false", "fsdp_offload_params: true", "fsdp_offload_params", "true cannot be imported: "
         "ftkit's fsdp.offload_params needs cuda"),
        ("fsdp_use_orig_params: true", "fsdp_transformer_layer_cls_to_wrap: Llama Layer",
         "fsdp_transformer_layer_cls_to_wrap", "Llama Layer cannot be imported: ftkit's fsdp.transformer_layer_cls "
         "must be Python class names"),
    ],
)  # fmt: skip
def test_a_value_ftkit_cannot_run_is_refused_at_the_source_line(tmp_path, model_dir, old, new, key, says):
    """Parameter offload on CPU ranks, a class name that is none: refused at the source's line, nothing written."""
    text = (FIX / "accelerate_fsdp1_cpu.yaml").read_text().replace(old, new)
    (tmp_path / "cpu.yaml").write_text(text)
    line = next(i for i, x in enumerate(text.splitlines(), 1) if x.strip().startswith(f"{key}:"))
    with pytest.raises(UserError) as e:
        import_to(tmp_path, model_dir, str(tmp_path / "cpu.yaml"))
    assert e.value.lines() == [f"{tmp_path / 'cpu.yaml'}:{line} fsdp_config.{key}: {says}" + e.value.lines()[0].split(
        says, 1)[1]], e.value.lines()  # fmt: skip
    assert not (tmp_path / "recipe.yaml").exists()


def test_axolotl_and_trainer_arguments_fsdp(here, tmp_path, model_dir):
    _, out = import_to(tmp_path, model_dir, "axolotl_fsdp.yml")
    r = _recipe(out)
    assert (r["train.backend"], r["fsdp.transformer_layer_cls"], r["fsdp.cpu_ram_efficient_loading"]) == (
        "fsdp2", "LlamaDecoderLayer", False)  # fmt: skip
    _, out = import_to(tmp_path, model_dir, "trainer_fsdp.yaml")
    r = _recipe(out)
    assert (r["train.backend"], r["fsdp.reshard_after_forward"], r["model.gradient_checkpointing"]) == ("fsdp2", True,
                                                                                                      True)  # fmt: skip
    assert (r["fsdp.state_dict_type"], r["train.max_steps"]) == ("full", 500)


def test_check_against_an_fsdp_config_finds_a_real_difference(here, tmp_path, model_dir):
    _, out = import_to(tmp_path, model_dir, "accelerate_fsdp_template.yaml")
    ok = cli("check", str(out), "--against", "accelerate_fsdp_template.yaml")
    assert ok.exit_code == 0, ok.output
    bad = cli("check", str(out), "fsdp.reshard_after_forward=false", "fsdp.state_dict_type=full", "--against",
              "accelerate_fsdp_template.yaml")  # fmt: skip
    assert bad.exit_code == 1, bad.output
    assert "fsdp_config.fsdp_sharding_strategy: true in accelerate_fsdp_template.yaml, the recipe renders false" in (
        bad.output)  # fmt: skip
    assert "fsdp_config.fsdp_state_dict_type" in bad.output
    plan = load_and_plan(str(out), [])
    assert accelerate_dict(plan, None)["fsdp_config"]["fsdp_version"] == 2
