"""Every source key is accounted for (issue 38): a test walks every fixture, imports it, and asserts each key of the
source is named in the report (mapped, default, "auto" resolved, not carried, refused); a block ftkit does not carry
(DeepSpeed's autotuning, profilers and monitors) is named key by key, never as one line that hides its keys. Every
fixture either imports, renders and checks clean against itself (``check --against``: no difference), or is refused
with a line naming the file, the line and the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from ftkit.errors import UserError
from ftkit.imports.build import read_sources
from ftkit.imports.mapping import FOLLOWED, HARD, MAPPED, REFUSED, leaves
from ftkit.imports.read import parse_command
from tests.imports.helpers import FIX, cli, import_to

SOURCES = sorted(
    p.name
    for p in FIX.iterdir()
    if p.is_file() and p.suffix in (".json", ".yaml", ".yml", ".sh", ".txt") and not p.name.startswith("hostfile")
)
# what a fixture's import needs: --accept (keys it refuses that can be carried without), or refused outright
ACCEPT = {
    "ds_torch_scheduler.json": "scheduler.type",
    "torchrun_cmd.txt": "warmup_ratio",
    "axolotl_qlora_packing.yml": "load_in_4bit,adapter,datasets,val_set_size,sample_packing,optimizer,special_tokens,"
    "warmup_steps",
    "llamafactory_lora_ds3.yaml": "dataset,template,max_samples,warmup_ratio,val_size",
    "accelerate_fsdp_local.yaml": "fsdp_config.fsdp_state_dict_type",
}
REFUSED_OUTRIGHT = {  # fixture -> the start of its refusal, which names the file, the line and the key
    "ds_z3_fp8.json": "ds_z3_fp8.json fp8: ",
    "ds_z3_concrete.json": "ds_z3_concrete.json zero_optimization.reduce_bucket_size: must be at least 1",
    "accelerate_fp8.yaml": "accelerate_fp8.yaml:2 mixed_precision: fp8",
    "accelerate_xpu.yaml": "accelerate_xpu.yaml:1 distributed_type: MULTI_XPU",
    "accelerate_multi_node.yaml": "accelerate_multi_node.yaml:7 main_process_ip: '1234' is a placeholder",
    "llamafactory_dpo.yaml": "llamafactory_dpo.yaml:2 stage: stage dpo",
    "axolotl_dpo.yml": "axolotl_dpo.yml:2 rl: rl dpo",
    "axolotl_tp_sp.yml": "axolotl_tp_sp.yml:10 tensor_parallel_size: tensor parallelism (size 2)",
    "accelerate_fsdp2_cp.yaml": "accelerate_fsdp2_cp.yaml:12 parallelism_config.parallelism_config_cp_size: context",
}


def _source_keys(path: Path) -> list[str]:
    """Every key the file states, dotted for nested blocks (a list is one value); a command line's options."""
    text = path.read_text()
    if path.suffix in (".sh", ".txt"):
        cmd = parse_command(text, path.name)
        launcher = cmd.launcher or "python"
        return [f"{launcher} --{k}" for k in cmd.launcher_opts] + [f"--{k}" for k in cmd.args]
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return [leaf for k, v in data.items() for leaf in leaves(str(k), v)]


@pytest.mark.parametrize("fixture", SOURCES)
def test_no_source_key_is_left_out_of_the_report(monkeypatch, model_dir, fixture):
    monkeypatch.chdir(FIX)
    report, _ = read_sources([fixture], model=str(model_dir))
    claims = [c for c in report.claims if c.source == fixture]
    named = {c.key.removesuffix(" (absent)") for c in claims}
    named |= {p.key for p in report.problems if p.file == fixture and p.key}  # a malformed value is named too
    # a block claimed as a whole covers its keys only when it is read under its own name (a followed or inline
    # config), mapped as one value, or refused; a block that is not carried names each of its keys
    blocks = {c.key for c in claims if c.status in (FOLLOWED, MAPPED, REFUSED, HARD)}
    missing = [
        key
        for key in _source_keys(FIX / fixture)
        if key not in named and not any(key.startswith(b + ".") for b in blocks)
    ]
    assert missing == [], f"{fixture}: keys the report does not name"


def test_launch_time_only_deepspeed_blocks_are_named_key_by_key(monkeypatch, tmp_path, model_dir):
    """A DeepSpeed autotuning block (4 keys) vanished from the rendered config and the report named none of them."""
    monkeypatch.chdir(FIX)
    result, _ = import_to(tmp_path, model_dir, "ds_z2_monitors.json")
    lines = result.lines
    for key in ("autotuning.enabled", "autotuning.fast", "autotuning.metric",
                "autotuning.arg_mappings.train_micro_batch_size_per_gpu",
                "flops_profiler.profile_step", "comms_logger.prof_all", "tensorboard.output_path",
                "wandb.project", "csv_monitor.job_name"):  # fmt: skip
        line = next((x for x in lines if x.startswith(f"ds_z2_monitors.json {key}: not carried")), None)
        assert line is not None, (key, lines)
    assert any("deepspeed --autotuning" in x for x in lines if " autotuning.enabled:" in x)


@pytest.mark.parametrize("fixture", [s for s in SOURCES if s not in REFUSED_OUTRIGHT])
def test_every_fixture_imports_renders_and_checks_clean(monkeypatch, tmp_path, model_dir, fixture):
    """The recipe loads and renders; against a DeepSpeed JSON or an Accelerate YAML, check --against finds no
    difference, apart from keys refused and accepted on import (they are not carried)."""
    from ftkit.imports import diff_against
    from ftkit.plan.load import load_and_plan
    from ftkit.render import render_files

    monkeypatch.chdir(FIX)
    result, out = import_to(tmp_path, model_dir, fixture, accept=ACCEPT.get(fixture, ""))
    overrides = ["cluster.master_addr=10.0.0.1"] if "cluster.master_addr" in result.placeholders else []
    plan = load_and_plan(str(out), overrides)
    assert render_files(plan, tmp_path / "configs")
    if fixture.endswith((".sh", ".txt")) or re.match(r"(axolotl|llamafactory|trainer|training)_", fixture):
        return  # check --against compares DeepSpeed and Accelerate files
    accepted = {a for a in ACCEPT.get(fixture, "").split(",") if a}
    diffs, _ = diff_against(plan, fixture)
    left = [d.line(fixture) for d in diffs if not any(a in d.key for a in accepted)]
    assert left == [], fixture


@pytest.mark.parametrize("fixture", sorted(REFUSED_OUTRIGHT))
def test_every_refused_fixture_names_file_line_and_key(monkeypatch, tmp_path, model_dir, fixture):
    monkeypatch.chdir(FIX)
    out = tmp_path / "recipe.yaml"
    r = cli("import", fixture, "-o", str(out), "--model", str(model_dir))
    assert r.exit_code == 2 and not out.exists(), r.output
    errors = [x.removeprefix("ftkit: error: ") for x in r.output.splitlines() if x.startswith("ftkit: error: ")]
    assert any(x.startswith(REFUSED_OUTRIGHT[fixture]) for x in errors), r.output
    with pytest.raises(UserError):
        import_to(tmp_path, model_dir, fixture)


@pytest.mark.parametrize("golden", ["cpu-demo", "full", "lora"])
def test_a_config_ftkit_rendered_imports_back_to_itself(tmp_path, model_dir, golden):
    """ftkit's own ds_config.json (its golden renders) imports into a recipe that renders it again, by meaning."""
    from ftkit.imports import diff_against
    from ftkit.plan.load import load_and_plan
    from tests.helpers.paths import GOLDEN

    (tmp_path / "ds_config.json").write_text((GOLDEN / golden / "ds_config.json").read_text())
    _, out = import_to(tmp_path, model_dir, str(tmp_path / "ds_config.json"))
    diffs, _ = diff_against(load_and_plan(str(out), []), str(tmp_path / "ds_config.json"))
    assert [d.line("ds_config.json") for d in diffs] == []
