"""DeepSpeed's own schedules (issue 38): carried from a source into the recipe (train.lr_scheduler and the scheduler
section), rendered back into ds_config.json's scheduler block with the numbers HF fills into "auto", shown by
``ftkit explain``; refused where they cannot run (another backend), where DeepSpeed cannot build them (a missing
total_num_steps, an "auto" HF never fills) or where they are no DeepSpeed or HF schedule."""

from __future__ import annotations

import json

import pytest

from ftkit.errors import RecipeError, UserError
from ftkit.plan.load import load_and_plan
from ftkit.render.deepspeed import render_deepspeed
from tests.imports.helpers import FIX, cli, import_to

SCHEDULES = ["ds_warmuplr_linear.json", "ds_warmupdecaylr_log.json", "ds_warmupcosinelr.json", "ds_onecycle.json",
             "ds_lrrangetest.json", "ds_z2_offload.json", "ds_z2_torch_adam.json"]  # fmt: skip


@pytest.fixture
def here(monkeypatch):
    monkeypatch.chdir(FIX)
    return FIX


@pytest.mark.parametrize("fixture", SCHEDULES)
def test_each_schedule_is_carried_with_every_parameter(here, tmp_path, model_dir, fixture):
    """The rendered block names the same schedule with the same parameters as the source, "auto" filled as HF
    fills it (peak: learning_rate, warm-up: max(1, warmup_steps), length: the run's steps)."""
    source = json.loads((FIX / fixture).read_text())["scheduler"]
    _, out = import_to(tmp_path, model_dir, fixture)
    plan = load_and_plan(str(out), [])
    rendered = render_deepspeed(plan)["scheduler"]
    assert rendered["type"] == source["type"]
    r = plan.recipe
    hf = {"warmup_max_lr": r.train.learning_rate, "warmup_min_lr": 0, "warmup_num_steps": max(1, r.train.warmup_steps)}
    for name, value in source["params"].items():
        want = hf[name] if value == "auto" and name in hf else value
        if name == "total_num_steps" and value == "auto":
            want = r.train.max_steps if r.train.max_steps is not None else "auto"
        assert rendered["params"][name] == pytest.approx(want), (name, rendered)
    assert "auto" not in json.dumps(rendered) or r.train.max_steps is None


def test_a_deepspeed_default_the_source_leaves_out_is_kept(here, tmp_path, model_dir):
    """WarmupDecayLR without warmup_num_steps and warmup_max_lr: DeepSpeed's 1000 warm-up steps and peak 0.001 (HF
    fills only keys that say "auto")."""
    cfg = {
        "zero_optimization": {"stage": 1},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}},
    }
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    result, out = import_to(tmp_path, model_dir, str(tmp_path / "ds.json"))
    params = render_deepspeed(load_and_plan(str(out), []))["scheduler"]["params"]
    assert (params["warmup_num_steps"], params["warmup_max_lr"], params["total_num_steps"]) == (1000, 0.001, 5000)
    assert params["warmup_type"] == "log"
    assert any("scheduler.params.warmup_num_steps (absent): mapped -> train.warmup_steps = 1000" in x
               for x in result.lines), result.lines  # fmt: skip


def test_explain_shows_the_resolved_numbers(write_recipe):
    p = write_recipe()
    r = cli("explain", str(p), "train.lr_scheduler=WarmupDecayLR", "train.warmup_steps=0", "train.max_steps=40",
            "scheduler.warmup_type=linear")  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split()[1] for line in r.output.splitlines() if line.startswith("  scheduler")}
    assert rows == {
        "scheduler": "WarmupDecayLR",
        "scheduler.warmup_max_lr": "0.0002",
        "scheduler.warmup_num_steps": "1",  # max(1, 0): DeepSpeed >= 0.19.6 refuses 0, HF fills 1
        "scheduler.total_num_steps": "40",
        "scheduler.warmup_type": "linear",
        "scheduler.warmup_min_lr": "0.0",
    }, r.output


def test_with_epochs_the_length_is_left_to_hf(write_recipe):
    cfg = render_deepspeed(
        load_and_plan(
            str(write_recipe()), ["train.lr_scheduler=WarmupCosineLR", "train.max_steps=null", "train.epochs=2"]
        )  # fmt: skip
    )
    assert cfg["scheduler"]["params"]["total_num_steps"] == "auto"
    assert "auto" not in json.dumps({k: v for k, v in cfg.items() if k != "scheduler"})


@pytest.mark.parametrize(
    "overrides,key,says",
    [
        (["train.lr_scheduler=WarmupLR", "train.backend=fsdp2"], "train.lr_scheduler", "needs train.backend deepspeed"),
        (["train.lr_scheduler=cosine", "scheduler.warmup_type=linear"], "scheduler.warmup_type", "applies to"),
        (["train.lr_scheduler=WarmupLR", "scheduler.cycle_max_lr=0.1"], "scheduler.cycle_max_lr", "OneCycle only"),
        (["train.lr_scheduler=OneCycle", "scheduler.cycle_max_lr=0.1"], "scheduler.cycle_min_lr", "required"),
    ],
)
def test_recipe_rules(write_recipe, overrides, key, says):
    with pytest.raises(RecipeError) as e:
        load_and_plan(str(write_recipe()), overrides)
    assert any(p.key == key and says in p.message for p in e.value.problems), e.value.lines()


@pytest.mark.parametrize(
    "params,says",
    [
        ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}, "WarmupDecayLR needs total_num_steps"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, "OneCycle needs cycle_max_lr"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": "auto"}}, "HF fills only"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "must be at least 1"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "must be log or linear"),
        ({"type": "warmuplr", "params": {}}, "DeepSpeed looks the schedule up as spelled: WarmupLR"),
    ],
)
def test_a_schedule_deepspeed_cannot_build_is_refused_at_its_key(tmp_path, model_dir, params, says):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}, "scheduler": params}))
    with pytest.raises(UserError) as e:
        import_to(tmp_path, model_dir, str(tmp_path / "ds.json"))
    assert any(says in p.message and "scheduler" in (p.key or "") for p in e.value.problems), e.value.lines()


def test_trainer_arguments_must_agree_with_a_concrete_schedule_as_hf_checks(tmp_path, model_dir):
    """HF refuses warmup_num_steps 100 with TrainingArguments warmup_steps 5 (fill_match); so does the import."""
    cfg = {"zero_optimization": {"stage": 1},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100, "warmup_max_lr": "auto"}}}  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    (tmp_path / "args.json").write_text(json.dumps({"warmup_steps": 5, "output_dir": "o", "deepspeed": "ds.json"}))
    with pytest.raises(UserError) as e:
        import_to(tmp_path, model_dir, str(tmp_path / "args.json"))
    assert "warmup_num_steps: 100 but TrainingArguments warmup_steps is 5" in str(e.value)


@pytest.mark.heavy
@pytest.mark.parametrize("fixture", SCHEDULES)
def test_deepspeed_builds_the_same_schedule_from_source_and_render(here, tmp_path, model_dir, fixture):
    """Both configs through HF's own "auto" filling, then DeepSpeed's scheduler class built from each (as its engine
    builds it): the same learning rate at every one of the run's steps."""
    pytest.importorskip("deepspeed")
    import torch
    from deepspeed.runtime import lr_schedules

    from tests.imports.test_import import _hf_filled

    _, out = import_to(tmp_path, model_dir, fixture)
    plan = load_and_plan(str(out), ["train.max_steps=120", "train.epochs=null"] if plan_in_epochs(out) else [])
    steps = plan.recipe.train.max_steps or 120
    source = _hf_filled(json.loads((FIX / fixture).read_text()), plan, tmp_path, steps)
    rendered = _hf_filled(render_deepspeed(plan), plan, tmp_path, steps)

    def lrs(cfg: dict) -> list[float]:
        block = cfg["scheduler"]
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg["optimizer"]["params"]["lr"])
        schedule = getattr(lr_schedules, block["type"])(optimizer, **block["params"])
        out = []
        for _ in range(min(steps, 400)):
            schedule.step()
            out.append(optimizer.param_groups[0]["lr"])
        return out

    assert lrs(rendered) == pytest.approx(lrs(source), rel=1e-12, abs=0)


def plan_in_epochs(recipe) -> bool:
    import yaml

    return yaml.safe_load(recipe.read_text())["train"]["max_steps"] is None


@pytest.mark.heavy
def test_a_resumed_run_with_a_new_peak_takes_it_from_deepspeeds_schedule():
    """A resume with train.learning_rate changed (an allowed change) stopped every rank with "no LR scheduler with
    base_lrs to update": DeepSpeed's schedules have none; they are rebuilt from the new ds_config.json and restore only
    their step, so the rank sets the restored param groups to the new schedule's rate at that step."""
    pytest.importorskip("deepspeed")
    import torch
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    from ftkit.launch.callback import apply_resume_overrides

    def build(peak: float) -> tuple[torch.optim.Optimizer, WarmupDecayLR]:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=peak)
        return opt, WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=peak, warmup_num_steps=4)

    opt, sched = build(1e-3)
    for _ in range(6):
        opt.step()
        sched.step()
    state, groups = sched.state_dict(), [dict(g) for g in opt.param_groups]
    opt2, sched2 = build(5e-4)  # the engine builds the schedule from the new config, then loads the checkpoint
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = groups[0]["lr"]  # the optimizer's state restores the old rate
    lines = apply_resume_overrides({"train.learning_rate": 5e-4}, opt2, sched2)
    assert lines == [f"train.learning_rate: DeepSpeed's WarmupDecayLR from ds_config.json; lr now {sched2.get_lr()[0]}"]
    assert opt2.param_groups[0]["lr"] == pytest.approx(groups[0]["lr"] / 2) == sched2.get_last_lr()[0]


@pytest.mark.heavy
def test_the_schedule_table_matches_deepspeeds_classes():
    """ftkit's table of DeepSpeed's schedules (parameters, defaults; None: required, or WarmupLR's optimizer lr) is
    the installed DeepSpeed's: read from each class's signature."""
    pytest.importorskip("deepspeed")
    import inspect

    from deepspeed.runtime import lr_schedules

    from ftkit.imports.deepspeed import SCHEDULE_PARAMS
    from ftkit.recipe.schema import DEEPSPEED_SCHEDULES

    assert sorted(SCHEDULE_PARAMS) == sorted(DEEPSPEED_SCHEDULES) == sorted(lr_schedules.VALID_LR_SCHEDULES)
    for name, table in SCHEDULE_PARAMS.items():
        params = inspect.signature(getattr(lr_schedules, name).__init__).parameters
        theirs = {k: (None if p.default is inspect.Parameter.empty else p.default) for k, p in params.items()}
        theirs = {k: v for k, v in theirs.items() if k not in ("self", "optimizer", "last_batch_iteration")}
        assert table == theirs, name


def test_the_scheduler_sections_defaults_are_deepspeeds():
    """A recipe that leaves a scheduler.* key out gets DeepSpeed's own default (the table above is DeepSpeed's)."""
    from ftkit.imports.deepspeed import SCHEDULE_PARAMS
    from ftkit.recipe.rules import SCHEDULER_PARAMS
    from ftkit.recipe.schema import FIELD_BY_KEY

    for schedule, names in SCHEDULER_PARAMS.items():
        for name in names:
            assert FIELD_BY_KEY[f"scheduler.{name}"].default == SCHEDULE_PARAMS[schedule][name], (schedule, name)
        carried = {n for n in SCHEDULE_PARAMS[schedule] if n not in ("warmup_max_lr", "warmup_num_steps",
                                                                     "total_num_steps")}  # fmt: skip
        assert carried == set(names), schedule
