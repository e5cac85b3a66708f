"""Rendering: DeepSpeed's and Accelerate's own code accept what ftkit writes, golden files pin the templates."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from ftkit.plan.load import load_and_plan
from ftkit.recipe.load import load_recipe
from ftkit.recipe.scaffold import RECIPE_TEMPLATES
from ftkit.render import ACCELERATE_FILE, DS_FILE, render_files
from ftkit.render.deepspeed import render_deepspeed
from tests.helpers.paths import GOLDEN, MODEL_CONFIGS, REPO

LLAMA8B = MODEL_CONFIGS / "Meta-Llama-3-8B.json"


def _cases():
    out = []
    for stage in (0, 1, 2, 3):
        offloads = [("none", "none")]
        if stage in (1, 2):
            offloads.append(("cpu", "none"))
        if stage == 3:
            offloads += [("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"), ("nvme", "nvme"), ("none", "cpu")]
        for opt, par in offloads:
            for precision in ("bf16", "fp16", "fp32"):
                for world in (1, 2, 16, 64):
                    out.append((stage, opt, par, precision, world))
    return out


def _cluster(world: int) -> list[str]:
    nodes, per = {1: (1, 1), 2: (1, 2), 16: (2, 8), 64: (8, 8)}[world]
    out = [f"cluster.num_nodes={nodes}", f"cluster.gpus_per_node={per}"]
    if nodes > 1:
        out.append("cluster.master_addr=10.0.0.1")
    return out


@pytest.fixture(scope="module")
def ds_config_class():
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as dsc

    return dsc


@pytest.mark.heavy
@pytest.mark.parametrize("stage,opt,par,precision,world", _cases())
def test_matrix_accepted_by_deepspeed_and_accelerate(
    stage, opt, par, precision, world, write_recipe, tmp_path, ds_config_class, monkeypatch
):
    p = write_recipe()
    overrides = [
        f"zero.stage={stage}",
        f"zero.offload_optimizer={opt}",
        f"zero.offload_params={par}",
        f"train.precision={precision}",
        "train.micro_batch_size=2",
        f"train.global_batch_size={world * 8}",
        *_cluster(world),
    ]
    if "nvme" in (opt, par):
        overrides.append(f"zero.nvme_path={tmp_path}/nvme")
    plan = load_and_plan(str(p), overrides)
    files = render_files(plan, tmp_path / "configs")
    cfg = json.loads(files[DS_FILE])

    # DeepSpeed's own parser, with the world size the plan used (offline it would see 1).
    monkeypatch.setattr(ds_config_class.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config_class.dist, "get_world_size", lambda *a, **k: world)
    ds = ds_config_class.DeepSpeedConfig(cfg)
    assert ds.world_size == world
    assert ds.train_batch_size == world * 8
    assert ds.train_micro_batch_size_per_gpu == 2
    assert ds.gradient_accumulation_steps == 4
    assert ds.zero_optimization_stage == stage
    assert ds.bfloat16_config.enabled == (precision == "bf16")
    assert ds.float16_config.enabled == (precision == "fp16")
    assert ds.gradient_clipping == 1.0
    zc = ds.zero_config
    if stage == 3:
        assert zc.overlap_comm is True
        assert isinstance(cfg["zero_optimization"]["stage3_prefetch_bucket_size"], int)
        assert zc.gather_16bit_weights_on_model_save is True
        assert (zc.offload_param is not None) == (par != "none")
    if opt != "none":
        assert str(getattr(zc.offload_optimizer.device, "value", zc.offload_optimizer.device)) == opt
    assert "auto" not in files[DS_FILE]

    # Accelerate's own loader rejects unknown keys; its DeepSpeed plugin refuses fields next to a config file.
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / DS_FILE).write_text(files[DS_FILE])
    acc_path = tmp_path / "configs" / ACCELERATE_FILE
    acc_path.write_text(files[ACCELERATE_FILE])
    from accelerate.commands.config.config_args import load_config_from_file

    acc = load_config_from_file(str(acc_path))
    assert acc.num_processes == world
    assert acc.num_machines == {1: 1, 2: 1, 16: 2, 64: 8}[world]
    assert acc.deepspeed_config["zero3_init_flag"] is (stage == 3)
    assert "mixed_precision" not in yaml.safe_load(files[ACCELERATE_FILE])
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.chdir(tmp_path)
    plugin = DeepSpeedPlugin(
        hf_ds_config=acc.deepspeed_config["deepspeed_config_file"],
        zero3_init_flag=acc.deepspeed_config["zero3_init_flag"],
    )
    assert plugin.zero_stage == stage


@pytest.mark.heavy
@pytest.mark.parametrize("world", [16, 64])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("variant", ["hpz", "hpz+qwz+qgz"])
def test_zeropp_candidates_accepted_by_deepspeed(
    variant, precision, world, write_recipe, tmp_path, ds_config_class, monkeypatch
):
    """Every ZeRO++ candidate the plan can choose renders a config DeepSpeed's own classes accept."""
    from ftkit.plan.comm import zeropp_candidates
    from ftkit.plan.plan import note_zeropp

    p = write_recipe()
    nodes, per = {16: (2, 8), 64: (8, 8)}[world]
    overrides = ["zero.stage=3", f"train.precision={precision}", "train.micro_batch_size=2"]
    overrides += [f"train.global_batch_size={world * 8}", *_cluster(world)]
    plan = load_and_plan(str(p), overrides)
    cand = {("hpz" if not c.qwz else "hpz+qwz+qgz"): c for c in zeropp_candidates(per, nodes)}[variant]
    note_zeropp(plan, cand, "test")
    cfg = json.loads(render_files(plan, tmp_path / "configs")[DS_FILE])
    z = cfg["zero_optimization"]
    assert z["zero_hpz_partition_size"] == per
    assert z["zero_quantized_weights"] is z["zero_quantized_gradients"] is (variant != "hpz")
    monkeypatch.setattr(ds_config_class.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config_class.dist, "get_world_size", lambda *a, **k: world)
    zc = ds_config_class.DeepSpeedConfig(cfg).zero_config
    assert zc.zero_hpz_partition_size == per
    assert zc.zero_quantized_weights is zc.zero_quantized_gradients is (variant != "hpz")


def test_auto_chooses_zeropp_on_a_slow_inter_node_link(write_recipe, tmp_path) -> None:
    """Llama-3-8B on 2 x 8 GPUs: 10 Gb/s Ethernet makes the inter-node link the bottleneck; NVLink + IB does not."""
    shutil.copy(LLAMA8B, tmp_path / "model" / "config.json")
    p = write_recipe()
    base = ["zero.stage=auto", "zero.offload_optimizer=auto", "cluster.num_nodes=2", "cluster.master_addr=10.0.0.1"]
    base += ["model.gradient_checkpointing=true"]
    base += ["data.max_seq_len=4096", "train.micro_batch_size=1", "train.global_batch_size=64"]
    slow = load_and_plan(str(p), [*base, "cluster.network=eth10"])
    fast = load_and_plan(str(p), [*base, "cluster.network=nvlink-ib400"])
    assert slow.knobs["zero_quantized_gradients"].value is True
    assert "zero_hpz_partition_size" not in fast.knobs
    cfg = render_deepspeed(slow)["zero_optimization"]
    assert (cfg["stage"], cfg["zero_hpz_partition_size"]) == (3, 8)


def _template_recipe(name: str, tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    shutil.copy(LLAMA8B, tmp_path / "model" / "config.json")
    p = tmp_path / "recipe.yaml"
    shutil.copy(REPO / "templates" / RECIPE_TEMPLATES[name][0], p)
    return p


@pytest.mark.parametrize("name", sorted(RECIPE_TEMPLATES))
def test_templates_match_golden_files(name, tmp_path):
    """The shipped templates (with a Llama-3-8B config) render exactly the checked-in golden files."""
    p = _template_recipe(name, tmp_path)
    files = render_files(load_and_plan(str(p), []), tmp_path / "configs")
    for fname, text in files.items():
        golden = GOLDEN / name / fname
        if os.environ.get("FTKIT_UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.read_text() == text, f"{golden} is stale: rerun with FTKIT_UPDATE_GOLDEN=1 if intended"


def test_render_is_deterministic_and_cli_writes_both(tmp_path):
    from tests.helpers.cli import run_ftkit

    p = _template_recipe("lora", tmp_path)
    r1 = run_ftkit("render", str(p))
    assert r1.returncode == 0, r1.stderr
    first = {f: (tmp_path / "configs" / f).read_bytes() for f in (DS_FILE, ACCELERATE_FILE)}
    r2 = run_ftkit("render", str(p))
    assert r2.returncode == 0
    assert {f: (tmp_path / "configs" / f).read_bytes() for f in (DS_FILE, ACCELERATE_FILE)} == first
    assert (
        yaml.safe_load(first[ACCELERATE_FILE])["deepspeed_config"]["deepspeed_config_file"] == "configs/ds_config.json"
    )


def test_check_in_sync_drift_and_bad_recipe(tmp_path):
    from tests.helpers.cli import run_ftkit

    p = _template_recipe("lora", tmp_path)
    assert run_ftkit("render", str(p)).returncode == 0
    ok = run_ftkit("check", str(p))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "in sync" in ok.stdout
    # a hand edit
    ds = tmp_path / "configs" / DS_FILE
    ds.write_text(ds.read_text().replace('"gradient_clipping": 1.0', '"gradient_clipping": 0.5'))
    drift = run_ftkit("check", str(p))
    assert drift.returncode == 1
    assert '-  "gradient_clipping": 0.5,' in drift.stdout and '+  "gradient_clipping": 1.0,' in drift.stdout
    # a changed recipe (override) drifts too, and a bad recipe is exit 2
    assert run_ftkit("render", str(p)).returncode == 0
    assert run_ftkit("check", str(p), "zero.stage=3").returncode == 1
    bad = run_ftkit("check", str(p), "zero.stag=3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    # a different ftkit version shows as drift in the YAML header
    acc = tmp_path / "configs" / ACCELERATE_FILE
    acc.write_text(acc.read_text().replace("Generated by ftkit ", "Generated by ftkit 0.0.9 was "))
    assert run_ftkit("check", str(p)).returncode == 1


def test_explain_names_rule_and_source(tmp_path):
    from tests.helpers.cli import run_ftkit

    p = _template_recipe("full", tmp_path)
    out = run_ftkit("explain", str(p), "train.max_grad_norm=0.3", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["knobs"]["reduce_bucket_size"] == {"value": 4096**2, "why": "hidden_size^2 = 4096^2"}
    assert data["knobs"]["gradient_clipping"]["value"] == 0.3
    assert data["recipe"]["train.max_grad_norm"]["source"] == "command line"
    assert data["knobs"]["zero_optimization.stage"]["why"].startswith("auto: ZeRO-")


def test_batch_triple_and_rules(write_recipe):
    p = write_recipe()
    plan = load_and_plan(str(p), ["cluster.gpus_per_node=4", "train.micro_batch_size=2", "train.global_batch_size=32"])
    cfg = render_deepspeed(plan)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (
        32,
        2,
        4,
    )
    z = cfg["zero_optimization"]
    assert z["reduce_bucket_size"] == 64 * 64 and z["contiguous_gradients"] is True
    assert z["round_robin_gradients"] is False
    off = render_deepspeed(load_and_plan(str(p), ["zero.offload_optimizer=cpu"]))["zero_optimization"]
    assert off["round_robin_gradients"] is True and off["offload_optimizer"]["device"] == "cpu"
    z3 = render_deepspeed(load_and_plan(str(p), ["zero.stage=3"]))["zero_optimization"]
    assert z3["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert z3["stage3_param_persistence_threshold"] == 640
    assert z3["stage3_gather_16bit_weights_on_model_save"] is True
    fp16 = render_deepspeed(load_and_plan(str(p), ["train.precision=fp16"]))
    assert fp16["fp16"]["enabled"] is True and fp16["fp16"]["loss_scale"] == 0 and fp16["bf16"]["enabled"] is False


def test_nested_config_hidden_size(write_recipe, model_dir):
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llava",
                "text_config": {"model_type": "llama", "hidden_size": 4096},
                "vision_config": {"hidden_size": 1024},
            }
        )
    )
    plan = load_and_plan(
        str(write_recipe()),
        ["zero.stage=3", "zero.overlap_comm=true", "zero.allgather_bucket_size=5e8"],
        with_memory=False,
    )
    assert plan.hidden_size == 4096
    assert render_deepspeed(plan)["zero_optimization"]["reduce_bucket_size"] == 4096**2


def test_a_hostfile_naming_only_this_machine_needs_no_ssh(write_recipe, tmp_path):
    import socket

    from ftkit.command.engines import build_launch
    from ftkit.run.job import launch_inputs

    hf = tmp_path / "hostfile"
    hf.write_text(f"{socket.gethostname()} slots=2\n")
    plan = load_and_plan(str(write_recipe()), [f"cluster.hostfile={hf}", "train.global_batch_size=16"])
    assert plan.hosts == [("localhost", 2)] and plan.master_addr == "127.0.0.1"
    (node,) = build_launch(launch_inputs(plan), {"PATH": "/bin"}).nodes
    assert not node.remote and "pdsh" not in node.argv and "deepspeed.launcher.launch" in node.argv  # no runner


def test_world_size_from_hostfile(write_recipe, tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("worker-1 slots=4\nworker-2 slots=4\n")
    r = load_recipe(write_recipe(), [f"cluster.hostfile={hf}", "train.global_batch_size=16"])
    plan = load_and_plan(str(r.path), [f"cluster.hostfile={hf}", "train.global_batch_size=16"])
    assert plan.world_size == 8 and plan.num_nodes == 2 and plan.master_addr == "worker-1" and plan.grad_accum == 1
    filtered = load_and_plan(str(r.path), [f"cluster.hostfile={hf}", "train.global_batch_size=16"], include="worker-2")
    assert filtered.world_size == 4 and filtered.grad_accum == 2


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_params=cpu", "cluster.accelerator=cuda"],
        ["zero.offload_optimizer=cpu", "train.precision=fp16"],
        ["zero.stage=3", "zero.offload_optimizer=nvme", "zero.offload_params=nvme", "zero.nvme_path=/tmp/nvme"],
    ],
)
def test_the_plan_decides_every_knob_before_rendering(write_recipe, tmp_path, overrides) -> None:
    """build_plan records every knob the configs carry, with its reason: rendering adds nothing to plan.knobs (so
    `ftkit explain` needs no render), and every value the plan decided is the one written."""
    plan = load_and_plan(str(write_recipe()), overrides)
    before = dict(plan.knobs)
    files = render_files(plan, tmp_path / "configs")
    assert plan.knobs == before
    cfg = json.loads(files[DS_FILE])
    z = cfg["zero_optimization"]
    for key in ("gradient_clipping", "precision", "optimizer", "zero3_init_flag", "contiguous_gradients"):
        assert key in before and before[key].why
    assert cfg["gradient_clipping"] == before["gradient_clipping"].value
    assert (
        yaml.safe_load(files[ACCELERATE_FILE])["deepspeed_config"]["zero3_init_flag"] is before["zero3_init_flag"].value
    )
    assert ("torch_adam" in cfg["optimizer"]["params"]) is ("optimizer.torch_adam" in before)
    for what in ("offload_optimizer", "offload_param"):
        assert (what in z) is (f"{what}.pin_memory" in before)
        if what in z:
            assert z[what]["pin_memory"] is before[f"{what}.pin_memory"].value
    if plan.stage == 3:
        assert z["sub_group_size"] == before["sub_group_size"].value
        assert "round_robin_gradients" not in before
    else:
        assert z["round_robin_gradients"] is before["round_robin_gradients"].value


def _optimizer_deepspeed_builds(cfg: dict, monkeypatch) -> object:
    """The optimizer DeepSpeed's engine constructs from ``cfg``'s optimizer block: its own code path
    (``DeepSpeedEngine.get_optimizer_configuration``, then the call ``_configure_basic_optimizer`` makes), on a
    stand-in engine whose answers come from DeepSpeed's own config class."""
    import types

    import deepspeed.runtime.config as dsc
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.setattr(dsc.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(dsc.dist, "get_world_size", lambda *a, **k: cfg["train_batch_size"] // (
        cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]))  # fmt: skip
    engine = types.SimpleNamespace(_config=dsc.DeepSpeedConfig(cfg), zenflow=False, client_optimizer=None)
    for name in ("zero_use_cpu_optimizer", "bf16_optimizer_states", "optimizer_name", "optimizer_params"):
        setattr(engine, name, types.MethodType(getattr(DeepSpeedEngine, name), engine))
    assert engine.optimizer_name() == "adamw"
    params = dict(engine.optimizer_params())
    params.pop("adam_w_mode", None)
    cls, kwargs = DeepSpeedEngine.get_optimizer_configuration(engine, params, True)
    if cls is not torch.optim.AdamW:  # constructing DeepSpeed's own would start the build this test rules out
        return cls
    return cls([torch.nn.Parameter(torch.zeros(4))], **params, **kwargs)


@pytest.mark.heavy
def test_no_rendered_config_makes_deepspeed_compile_an_op(tmp_path, monkeypatch):
    """Issue 35: every default template and every golden recipe renders a config from which DeepSpeed builds torch's
    fused AdamW (nothing to compile): never DeepSpeed's FusedAdam (a just-in-time nvcc build on every rank, which
    crash-looped on a GPU machine) or CPU Adam (the same build with offload), and no NVMe offload (async I/O op)."""
    pytest.importorskip("deepspeed")
    import torch

    configs = {}
    for n in RECIPE_TEMPLATES:
        (tmp_path / n).mkdir()
        configs[f"template {n}"] = render_deepspeed(load_and_plan(str(_template_recipe(n, tmp_path / n)), []))
    configs |= {
        f"golden {p.parent.name}": json.loads(p.read_text()) for p in (GOLDEN / "outputs").glob("*/ds_config.json")
    }
    assert len(configs) > 40
    for name, cfg in configs.items():
        opt = _optimizer_deepspeed_builds(cfg, monkeypatch)
        assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True, f"{name}: {opt}"
        zero = cfg["zero_optimization"]
        assert "nvme" not in {
            zero.get("offload_optimizer", {}).get("device"),
            zero.get("offload_param", {}).get("device"),
        }, name
