"""Recipe loading: precedence, unknown keys, types, line numbers, every problem at once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ftkit.errors import RecipeError
from ftkit.recipe.load import CLI, DEFAULT, load_recipe, parse_override


def test_precedence_cli_over_file_over_default(write_recipe):
    """CLI key=value > recipe file > defaults, all three in one recipe."""
    p = write_recipe("""\
        model: {path: ./model}
        data: {train: ./data.jsonl}
        train:
          output_dir: ./run
          learning_rate: 0.001
          seed: 7
    """)
    r = load_recipe(p, ["train.seed=99"])
    assert r["train.seed"] == 99 and r.sources["train.seed"] == CLI  # CLI beats the file
    assert r["train.learning_rate"] == 0.001 and r.sources["train.learning_rate"] == f"{p}:5"  # file beats default
    assert r["train.max_grad_norm"] == 1.0 and r.sources["train.max_grad_norm"] == DEFAULT  # default


def test_overrides_are_typed():
    assert parse_override("zero.stage=3") == ("zero.stage", 3)
    assert parse_override("model.gradient_checkpointing=true") == ("model.gradient_checkpointing", True)
    assert parse_override("cluster.hostfile=null") == ("cluster.hostfile", None)
    assert parse_override("peft.target_modules=[q_proj, v_proj]") == ("peft.target_modules", ["q_proj", "v_proj"])
    assert parse_override("train.learning_rate=2e-4") == ("train.learning_rate", 2e-4)


def test_unknown_key_has_line_and_suggestion(write_recipe):
    p = write_recipe("""\
        model: {path: ./model}
        data: {train: ./data.jsonl}
        train: {output_dir: ./run}
        zero:
          stag: 3
    """)
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert e.value.lines() == [
        f"{p}:5 zero.stag: unknown key (did you mean 'stage'?); zero has stage, "
        "offload_optimizer, offload_params, nvme_path, cpu_adam, overlap_comm, reduce_bucket_size, "
        "allgather_bucket_size, contiguous_gradients, round_robin_gradients, pin_memory, sub_group_size, "
        "prefetch_bucket_size, param_persistence_threshold, max_live_parameters, max_reuse_distance"
    ]


def test_unknown_section_and_cli_key(write_recipe):
    p = write_recipe("""\
        model: {path: ./model}
        data: {train: ./data.jsonl}
        train: {output_dir: ./run}
        zeroo: {stage: 3}
    """)
    with pytest.raises(RecipeError) as e:
        load_recipe(p, ["train.lerning_rate=1"])
    lines = e.value.lines()
    assert lines[0].startswith(f"{p}:4 zeroo: unknown section (did you mean 'zero'?)")
    assert lines[1].startswith("command line train.lerning_rate: unknown key (did you mean 'learning_rate'?)")


def test_all_problems_reported_at_once(write_recipe):
    p = write_recipe("""\
        model: {path: ./model}
        data: {train: ./data.jsonl, max_seq_len: -5}
        train:
          output_dir: ./run
          precision: bf61
          micro_batch_size: four
          learning_rate: 0
    """)
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    lines = e.value.lines()
    assert len(lines) == 4, lines
    assert f"{p}:2 data.max_seq_len: must be greater than 0; got -5" in lines
    assert f"{p}:5 train.precision: must be one of bf16, fp16, fp32; got 'bf61' (did you mean 'bf16'?)" in lines
    assert f"{p}:6 train.micro_batch_size: expected int, got text 'four'" in lines
    assert f"{p}:7 train.learning_rate: must be greater than 0; got 0" in lines


def test_broken_yaml_names_line(write_recipe):
    p = write_recipe("model:\n  path: ./model\n data: [\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    (line,) = e.value.lines()
    assert line.startswith(f"{p}:3: invalid YAML")


def test_missing_required_keys(write_recipe):
    p = write_recipe("train: {precision: fp32}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    keys = [pr.key for pr in e.value.problems]
    assert keys == ["model.path", "data.train", "train.output_dir"]


def test_offload_params_needs_stage_3(write_recipe):
    p = write_recipe("""\
        model: {path: ./model}
        data: {train: ./data.jsonl}
        train: {output_dir: ./run}
        zero:
          stage: 2
          offload_params: cpu
    """)
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert e.value.lines() == [
        f"{p}:6 zero.offload_params: parameter offload needs ZeRO stage 3 (zero.stage is 2); "
        "set zero.stage: 3 or offload_params: none"
    ]
    assert load_recipe(p, ["zero.stage=3"])["zero.offload_params"] == "cpu"


def test_nvme_needs_path(write_recipe):
    p = write_recipe()
    with pytest.raises(RecipeError, match="zero.nvme_path: required when offloading to nvme"):
        load_recipe(p, ["zero.offload_optimizer=nvme"])


def test_paths_relative_to_recipe_file_and_cli_to_cwd(write_recipe, tmp_path, monkeypatch):
    p = write_recipe()
    monkeypatch.chdir("/")
    r = load_recipe(p, ["data.train=tmp/x.jsonl"])
    assert r["model.path"] == str(tmp_path / "model")
    assert r["data.train"] == os.path.abspath("/tmp/x.jsonl")


def test_stage_accepts_auto_and_rejects_bad(write_recipe):
    p = write_recipe()
    assert load_recipe(p, ["zero.stage=auto"])["zero.stage"] == "auto"
    with pytest.raises(RecipeError, match="zero.stage: must be at most 3; got 4"):
        load_recipe(p, ["zero.stage=4"])
    with pytest.raises(RecipeError, match="zero.stage: expected int or auto, got text 'three'"):
        load_recipe(p, ["zero.stage=three"])


def test_peft_section_presence(write_recipe):
    p = write_recipe()
    assert not load_recipe(p).has_peft
    r = load_recipe(p, ["peft.r=8"])
    assert r.has_peft and r["peft.r"] == 8 and r["peft.target_modules"] == ["q_proj", "v_proj"]


def test_recipe_hash_changes_with_values(write_recipe):
    p = write_recipe()
    assert load_recipe(p).hash() == load_recipe(p).hash()
    assert load_recipe(p).hash() != load_recipe(p, ["train.seed=1"]).hash()


def test_not_a_mapping(tmp_path: Path):
    p = tmp_path / "r.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match=r"r.yaml:1: the recipe must be a mapping"):
        load_recipe(p)


def test_missing_file(tmp_path: Path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------------------------------------------
# Boundary validation (issue 10): values that reach command lines and shells, numbers, and hostile YAML


@pytest.mark.parametrize(
    "addr",
    [
        "$(touch /tmp/x)",
        "`touch /tmp/x`",
        "10.0.0.1;touch /tmp/x",
        "a b",
        "'node1'",
        '"node1"',
        "-oProxyCommand=x",
        "node_1",
        "999.1.1.1",
        "node..a",
        "-node",
        "x" * 64 + ".example",
    ],
)
def test_master_addr_must_be_a_host_name_or_ip(write_recipe, addr):
    p = write_recipe()
    with pytest.raises(RecipeError) as e:
        load_recipe(p, [f"cluster.master_addr={json.dumps(addr)}"])  # a YAML string holding exactly addr
    (line,) = e.value.lines()
    assert line.startswith("command line cluster.master_addr: must be a host name") and "IP address" in line


@pytest.mark.parametrize(
    "addr", ["node-1", "node1.cluster.example.com", "node1.example.", "10.0.0.1", "::1", "fe80::1"]
)
def test_master_addr_accepts_names_and_ip_literals(write_recipe, addr):
    assert load_recipe(write_recipe(), [f"cluster.master_addr={addr}"])["cluster.master_addr"] == addr


def test_master_addr_in_the_file_names_its_line(write_recipe):
    p = write_recipe(MINIMAL_WITH + 'cluster:\n  master_addr: "$(touch /tmp/x)"\n')
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert e.value.lines()[0].startswith(f"{p}:6 cluster.master_addr: must be a host name")


def test_master_port_is_a_tcp_port(write_recipe):
    p = write_recipe()
    with pytest.raises(RecipeError, match="cluster.master_port: must be at most 65535; got 99999999"):
        load_recipe(p, ["cluster.master_port=99999999"])
    with pytest.raises(RecipeError, match="cluster.master_port: must be at least 1; got 0"):
        load_recipe(p, ["cluster.master_port=0"])
    assert load_recipe(p, ["cluster.master_port=65535"])["cluster.master_port"] == 65535


@pytest.mark.parametrize("name", ["team/exp1", "exp 1", "a" * 65, "$(id)", "x;y", "é"])
def test_name_is_a_safe_identifier(write_recipe, name):
    with pytest.raises(RecipeError, match=r"^command line name: must be 1 to 64 letters, digits"):
        load_recipe(write_recipe(), [f"name={name}"])


def test_name_accepts_identifiers(write_recipe):
    assert load_recipe(write_recipe(), ["name=team.exp-1_b"])["name"] == "team.exp-1_b"
    assert load_recipe(write_recipe(), ["name=" + "a" * 64])["name"] == "a" * 64


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e999", "inf", "nan"])
def test_floats_are_finite(write_recipe, value):
    p = write_recipe(MINIMAL_WITH.replace("output_dir: ./run", f"output_dir: ./run\n  learning_rate: {value}"))
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    (line,) = e.value.lines()
    assert line.startswith(f"{p}:5 train.learning_rate: must be a finite number"), line
    with pytest.raises(RecipeError, match="command line train.epochs: must be a finite number"):
        load_recipe(write_recipe(), [f"train.epochs={value}", "train.max_steps=null"])


def test_adam_betas_below_one(write_recipe):
    with pytest.raises(RecipeError, match="train.adam_beta2: must be less than 1; got 1"):
        load_recipe(write_recipe(), ["train.adam_beta2=1"])


def test_duplicate_keys_name_both_lines(write_recipe):
    p = write_recipe(MINIMAL_WITH + "train:\n  seed: 1\n  learning_rate: 0.1\n  seed: 2\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    lines = e.value.lines()
    assert (
        f"{p}:5 train: duplicate key (also set at line 3); YAML would silently keep the last one: remove one" in lines
    )
    assert (
        f"{p}:8 train.seed: duplicate key (also set at line 6); YAML would silently keep the last one: remove one"
        in lines
    )


def test_merge_keys_are_not_duplicates(write_recipe):
    p = write_recipe(
        "model: {path: ./model}\ndata: {train: ./data.jsonl}\n"
        "train: &t {output_dir: ./run, seed: 3}\nzero: {stage: 1}\n"
    )
    assert load_recipe(p)["train.seed"] == 3


def _laughs(mapping: bool) -> str:
    """The classic "billion laughs": 9 levels of 9 aliases each, 10^9 values from under 800 bytes."""
    lines = [
        "a: &a {k1: lol, k2: lol, k3: lol, k4: lol, k5: lol, k6: lol, k7: lol, k8: lol, k9: lol}"
        if mapping
        else 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'
    ]
    prev = "a"
    for n in "bcdefghi":
        refs = [f"k{j}: *{prev}" for j in range(1, 10)] if mapping else [f"*{prev}"] * 9
        lines.append(f"{n}: &{n} " + ("{" + ", ".join(refs) + "}" if mapping else "[" + ",".join(refs) + "]"))
        prev = n
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("mapping", [False, True], ids=["list", "mapping"])
def test_alias_bomb_refused_in_milliseconds(tmp_path, mapping):
    """A 773-byte alias bomb exhausted memory. Refused from the event stream, before it is composed; the CLI runs
    under a 1 GiB address-space limit so the old code fails here instead of eating the machine."""
    import resource
    import subprocess
    import sys
    import time

    p = tmp_path / "bomb.yaml"
    p.write_text(_laughs(mapping))
    assert len(p.read_bytes()) < 800

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    def cpu_of_children() -> float:  # CPU time, not wall time: a busy machine (CI) does not change it
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    t0 = cpu_of_children()
    out = subprocess.run(
        [sys.executable, "-m", "ftkit", "explain", str(p)], capture_output=True, text=True, timeout=60, preexec_fn=limit
    )
    elapsed = cpu_of_children() - t0
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "alias bomb" in out.stderr and "Traceback" not in out.stderr
    assert elapsed < 5.0, elapsed  # ~0.4 CPU-s, interpreter start-up included; the refusal itself is timed below

    t0 = time.process_time()
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    elapsed = time.process_time() - t0
    assert elapsed < 1.0, elapsed
    (line,) = e.value.lines()
    assert "YAML expands to more than" in line and "alias" in line


def test_recursive_alias_and_deep_nesting_refused(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("a: &a [1, *a]\n")
    with pytest.raises(RecipeError, match=r"r.yaml:1: recursive YAML alias \*a"):
        load_recipe(p)
    p.write_text("a: " + "[" * 40 + "]" * 40 + "\n")
    with pytest.raises(RecipeError, match=r"r.yaml:1: nested deeper than 32 levels"):
        load_recipe(p)
    p.write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")  # libyaml's composer overflowed the C stack here
    # libyaml 0.2.6 (in PyYAML 6.0.4's wheels) stops at its own flow-level limit (1,000) while scanning ahead,
    # before ftkit's event check sees level 33; either way one line, no crash.
    deep = r"r.yaml:1: (nested deeper than 32 levels|invalid YAML: exceeded maximum nesting depth)$"
    with pytest.raises(RecipeError, match=deep):
        load_recipe(p)


def test_alias_bomb_in_an_override_refused():
    bomb = "[&a [x,x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], "
    bomb += "[*c,*c,*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]]"
    with pytest.raises(RecipeError, match=r"^command line peft.target_modules: YAML expands to more than"):
        parse_override(f"peft.target_modules={bomb}")


def test_recipe_size_cap(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("# padding\n" * 200_000)
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert e.value.lines() == [f"{p}: larger than 1 MiB: a recipe is a few KiB of settings; is this the right file?"]


MINIMAL_WITH = "model: {path: ./model}\ndata: {train: ./data.jsonl}\ntrain:\n  output_dir: ./run\n"


def test_eval_report_to_command_and_resilience_keys_have_documented_defaults(write_recipe):
    r = load_recipe(write_recipe())
    assert r["data.eval"] is None and r["train.eval_steps"] is None and r["train.report_to"] == []
    assert r["train.command"] is None
    assert r["resilience.stop_timeout_s"] == 120 and r["resilience.exclude_stragglers"] is False


def test_eval_file_is_a_path_relative_to_the_recipe(write_recipe, tmp_path):
    p = write_recipe(MINIMAL_WITH.replace("./data.jsonl}", "./data.jsonl, eval: ./eval.jsonl}"))
    r = load_recipe(p, ["train.eval_steps=5", "train.report_to=[tensorboard, wandb]"])
    assert r["data.eval"] == str((tmp_path / "eval.jsonl").resolve())
    assert r["train.eval_steps"] == 5 and r["train.report_to"] == ["tensorboard", "wandb"]


def test_report_to_refuses_unknown_targets_and_none_with_others(write_recipe):
    with pytest.raises(RecipeError) as e:
        load_recipe(write_recipe(), ["train.report_to=[tensorbord]"])
    (line,) = e.value.lines()
    assert line == (
        "command line train.report_to: items must be among tensorboard, wandb, mlflow, none; got 'tensorbord' "
        "(did you mean 'tensorboard'?)"
    )
    with pytest.raises(RecipeError, match="'none' cannot be combined"):
        load_recipe(write_recipe(), ["train.report_to=[none, wandb]"])
    with pytest.raises(RecipeError, match="train.report_to: expected list of tensorboard"):
        load_recipe(write_recipe(), ["train.report_to=tensorboard"])  # a bare word, not a list
    assert load_recipe(write_recipe(), ["train.report_to=[none]"])["train.report_to"] == ["none"]


def test_command_is_a_list_of_printable_words(write_recipe):
    p = write_recipe()
    ok = load_recipe(p, ['train.command=[python, "my script.py", --lr, "", "$(x)"]'])
    assert ok["train.command"] == ["python", "my script.py", "--lr", "", "$(x)"]  # quoted once where argv is built
    with pytest.raises(RecipeError, match=r"^command line train.command: the first word must not be empty"):
        load_recipe(p, ['train.command=["  ", sft.py]'])
    with pytest.raises(RecipeError, match=r"^command line train.command: item 2: must be printable text"):
        load_recipe(p, ['train.command=[python, "a\\nb"]'])
    with pytest.raises(RecipeError, match=r"train.command: must list at least one item \(null: none\)"):
        load_recipe(p, ["train.command=[]"])
    with pytest.raises(RecipeError, match=r"train.command: expected list\[str\] or null, got text"):
        load_recipe(p, ["train.command=python sft.py"])  # one string, not a list of words


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("resilience.stop_timeout_s=0", "must be greater than 0"),
        ("resilience.exclude_stragglers=maybe", "expected bool"),
        ("train.eval_steps=0", "must be greater than 0"),
    ],
)
def test_new_keys_are_bounded(write_recipe, override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(write_recipe(), [override])


@pytest.mark.heavy
def test_eval_and_report_to_reach_training_arguments_that_transformers_accepts(write_recipe, tmp_path):
    """The recipe's eval and reporting keys become TrainingArguments kwargs, checked by transformers' own class."""
    from transformers import TrainingArguments

    from ftkit.plan.plan import build_plan
    from ftkit.run.make_spec import training_arguments
    from ftkit.rundir.layout import tensorboard_dir

    base = ["cluster.accelerator=cpu", "cluster.gpus_per_node=2", "train.precision=fp32", "train.save_steps=6"]
    rec = write_recipe()

    def targs(*overrides: str) -> dict:
        plan = build_plan(load_recipe(rec, [*base, *overrides]), with_memory=False)
        return training_arguments(plan, str(tmp_path / "run"), str(tmp_path / "ds.json"))

    plain = targs()
    assert "eval_strategy" not in plain and plain["report_to"] == []
    assert plain["include_num_input_tokens_seen"] == "non_padding"
    local = {"deepspeed": None, "ddp_backend": None}  # no DeepSpeed config file, no process group in this process
    TrainingArguments(**{**plain, **local})

    ev = targs(f"data.eval={tmp_path / 'eval.jsonl'}", "train.report_to=[tensorboard]")
    assert ev["eval_strategy"] == "steps" and ev["eval_steps"] == 6  # null: every save_steps
    assert ev["per_device_eval_batch_size"] == ev["per_device_train_batch_size"]
    assert ev["report_to"] == ["tensorboard"]
    assert targs(f"data.eval={tmp_path / 'e.jsonl'}", "train.eval_steps=3")["eval_steps"] == 3
    a = TrainingArguments(**{**ev, **local})
    assert a.eval_strategy == "steps" and a.eval_steps == 6 and a.include_num_input_tokens_seen == "non_padding"
    assert tensorboard_dir(tmp_path / "run") == str(tmp_path / "run" / "tensorboard")
