"""Recipe loading: precedence, unknown keys, types, line numbers, every problem at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ftkit.errors import RecipeError
from ftkit.recipe import CLI, DEFAULT, load_recipe, parse_override


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
        "offload_optimizer, offload_params, nvme_path, overlap_comm, reduce_bucket_size, "
        "allgather_bucket_size"
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
