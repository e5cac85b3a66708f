"""The whole import (issue 38): a recipe that does not load is never written, its problem named at the source's
line (a placeholder named as one); ``--plan`` sets ftkit's planner against what the sources chose."""

from __future__ import annotations

import pytest

from ftkit.errors import UserError
from ftkit.imports.build import placeholder_address
from tests.imports.helpers import FIX, cli, import_to


@pytest.fixture
def here(monkeypatch):
    monkeypatch.chdir(FIX)
    return FIX


def test_a_placeholder_address_is_refused_at_its_source_line_and_nothing_is_written(here, tmp_path, model_dir):
    """Accelerate's multi_node.yaml template (main_process_ip: '1234') imported into a recipe ftkit itself then
    refused to load (`recipe.yaml:172 cluster.master_addr ...`)."""
    out = tmp_path / "recipe.yaml"
    r = cli("import", "accelerate_multi_node.yaml", "-o", str(out), "--model", str(model_dir))
    assert r.exit_code == 2 and not out.exists(), r.output
    errors = [x for x in r.output.splitlines() if x.startswith("ftkit: error: ")]
    want = (
        "ftkit: error: accelerate_multi_node.yaml:7 main_process_ip: '1234' is a placeholder, not rank 0's address: "
        "write the main node's host name or IP address there (or pass --hostfile)"
    )
    assert errors == [want]
    text = (FIX / "accelerate_multi_node.yaml").read_text().replace("'1234'", "10.0.0.7")
    (tmp_path / "filled.yaml").write_text(text)
    result, out = import_to(tmp_path, model_dir, str(tmp_path / "filled.yaml"))
    assert "cluster:\n" in result.recipe_text and "master_addr: 10.0.0.7" in result.recipe_text


@pytest.mark.parametrize("value", ["1234", "<MAIN_IP>", "MASTER_ADDR", "${MASTER_ADDR}", "x.x.x.x"])
def test_placeholder_addresses(value):
    assert placeholder_address(value)


@pytest.mark.parametrize("value", ["10.0.0.1", "node-0", "gpu01.cluster", "::1"])
def test_real_addresses_are_no_placeholders(value):
    assert not placeholder_address(value)


def test_any_value_the_recipe_refuses_names_its_source(tmp_path, model_dir):
    """Not only addresses: every recipe problem a source value causes is reported at that value."""
    (tmp_path / "args.json").write_text('{"output_dir": "o", "adam_beta2": 1.5, "per_device_train_batch_size": 2}')
    with pytest.raises(UserError) as e:
        import_to(tmp_path, model_dir, str(tmp_path / "args.json"))
    assert e.value.lines() == [
        f"{tmp_path / 'args.json'} adam_beta2: 1.5 cannot be imported: ftkit's train.adam_beta2 must be less than 1; "
        "got 1.5"
    ] or all(str(tmp_path / "args.json") in x and "adam_beta2" in x for x in e.value.lines()), e.value.lines()


def test_plan_compares_ftkits_choice_with_the_sources(here, tmp_path, model_dir):
    out = tmp_path / "recipe.yaml"
    r = cli("import", "ds_z3_offload_all.json", "-o", str(out), "--model", str(model_dir), "--plan")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    start = lines.index("plan: what ftkit's planner chooses for this job against what the sources chose")
    table = lines[start : start + 7]
    assert table[1].split() == ["the", "sources", "ftkit", "plan", "(zero.stage:", "auto,", "zero.offload_optimizer:",
                                "auto)"]  # fmt: skip
    sharding = table[2]
    assert sharding.startswith("  sharding        ZeRO-3 + optimizer offload (cpu) + param offload (cpu)"), table
    assert "ZeRO-1" in sharding.split("param offload (cpu)", 1)[1], table  # a tiny model fits without sharding
    assert table[3].startswith("  micro batch") and "GiB" in table[4] and table[5].startswith("  predicted step")
    assert table[6].startswith("  to adopt ftkit's choice, set zero.stage=1 zero.offload_optimizer=none"), table
    assert out.exists()


def test_plan_of_an_fsdp_source_lets_zero_and_fsdp2_compete(here, tmp_path, model_dir):
    result, _ = import_to(tmp_path, model_dir, "accelerate_config_fsdp2.yaml", plan=True)
    text = "\n".join(result.plan)
    assert "train.backend: auto" in text and "  sharding        FSDP2" in text, text


def test_plan_without_a_model_says_what_it_needs(here, tmp_path):
    result, _ = import_to(tmp_path, None, "ds_z3.json", plan=True)
    assert result.plan[0].startswith("plan: not computed:") and "--model" in result.plan[0], result.plan
