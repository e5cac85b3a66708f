"""The typed recipe sections (ftkit/rundir/sections.py) agree with the one schema table: the same fields, in order,
with the Python type of each schema type; a loaded recipe's sections hold its values."""

from __future__ import annotations

import dataclasses
import typing

from ftkit.recipe.load import load_recipe
from ftkit.recipe.schema import SECTIONS
from ftkit.rundir import sections

PY = {"bool": bool, "int": int, "float": float, "str": str, "path": str, "host": str, "choice": str, "auto": str}


def _expected(schema_type: str) -> set:
    out = set()
    for part in schema_type.split("|"):
        if part == "null":
            out.add(type(None))
        elif part.startswith("list["):
            out.add(list[str])
        else:
            out.add(PY[part])
    return out


def test_every_section_class_matches_the_schema_table():
    assert list(sections.SECTION_TYPES) == [s.name for s in SECTIONS]
    for s in SECTIONS:
        cls = sections.SECTION_TYPES[s.name]
        hints = typing.get_type_hints(cls)
        assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in s.fields], s.name
        for f in s.fields:
            hint = hints[f.name]
            union = typing.get_origin(hint) in (typing.Union, __import__("types").UnionType)
            got = set(typing.get_args(hint)) if union else {hint}
            assert got == _expected(f.type), (s.name, f.name, f.type, hints[f.name])
        assert cls.__dataclass_params__.frozen


def test_a_loaded_recipe_reads_by_section(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (tmp_path / "recipe.yaml").write_text(
        "model: {path: ./model}\ndata: {train: ./d.jsonl}\ntrain: {output_dir: ./run, micro_batch_size: 2, "
        "global_batch_size: 16, save_steps: 7}\ncluster: {gpus_per_node: 8}\n"
    )
    r = load_recipe(str(tmp_path / "recipe.yaml"), ["zero.stage=3"])
    assert r.train.save_steps == 7 and r.zero.stage == 3 and r.peft is None
    assert r.model.path == str((tmp_path / "model").resolve()) and r.train.output_dir == str(
        (tmp_path / "run").resolve()
    )
    assert r.cluster.gpus_per_node == 8 and r.resilience.max_restarts == r["resilience.max_restarts"]
