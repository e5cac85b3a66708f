"""Commented recipes: every key with its one-line doc (from :mod:`ftkit.recipe.schema`) above it.

The shipped templates in ``templates/`` are exactly what :func:`commented_recipe` makes of their own values (a test
holds them to it), so the comments a user reads after ``ftkit init`` never drift from the loader's docs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import yaml

from ftkit.recipe.schema import REQUIRED, SECTIONS, TOP_LEVEL, Field


def field_comment(f: Field) -> str:
    """The single line shown above a key: doc, plus the default where there is one."""
    if f.default is REQUIRED:
        return f"# {f.doc} Required."
    return f"# {f.doc} Default: {format_value(f.default)}."


def format_value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()


def commented_recipe(values: Mapping[str, object], header: list[str]) -> str:
    """YAML text for nested ``values`` (sections as in the schema); ``peft: None`` means no peft section."""
    out = [line.rstrip() for line in header]
    for f in TOP_LEVEL:
        if f.name in values:
            out += ["", field_comment(f), f"{f.name}: {format_value(values[f.name])}"]
    for s in SECTIONS:
        if s.name not in values:
            continue
        body = values[s.name]
        out.append("")
        if body is None:  # shown commented out, with the defaults, ready to uncomment
            out += [f"# {s.doc}", f"# {s.name}:"]
            out += [f"#   {f.name}: {format_value(f.default)}" for f in s.fields]
            continue
        out += [f"# {s.doc}", f"{s.name}:"]
        body = cast("Mapping[str, object]", body)  # a section: a mapping of its keys
        for f in s.fields:
            if f.name in body:
                out += [f"  {field_comment(f)}", f"  {f.name}: {format_value(body[f.name])}"]
    return "\n".join(out) + "\n"


def split_header(text: str) -> list[str]:
    """The leading comment block of a template (its description), kept verbatim by commented_recipe."""
    header = []
    for line in text.splitlines():
        if line.startswith("#"):
            header.append(line)
        else:
            break
    return header


# The shipped templates live in ``templates/``, installed as the package ``ftkit.templates``.
RECIPE_TEMPLATES = {
    "lora": ("lora.yaml", "LoRA fine-tuning on GPUs (ZeRO-2)."),
    "full": ("full.yaml", "Full fine-tuning on GPUs (ZeRO stage chosen by ftkit plan)."),
    "cpu-demo": (
        "cpu-demo.yaml",
        "Full fine-tuning of a tiny model with 2 CPU processes (ZeRO-2); what make demo runs.",
    ),
}
HOSTFILE_TEMPLATE = "hostfile"


def read_template(filename: str) -> str:
    from importlib import resources

    return resources.files("ftkit.templates").joinpath(filename).read_text(encoding="utf-8")


def regenerated(text: str) -> str:
    """What a template should read after the schema's docs change: same header and values, fresh comments."""
    values = yaml.safe_load(text) or {}
    for s in SECTIONS:
        if s.optional and s.name not in values:
            values[s.name] = None
    return commented_recipe(values, split_header(text))


def with_model(text: str, model: str, revision: str | None = None) -> str:
    """A template's text with ``model.path`` set to ``model`` (a hub id or a directory) and, for a pinned hub
    revision, ``model.revision``; comments regenerated from the schema like the shipped templates."""
    values = yaml.safe_load(text) or {}
    for s in SECTIONS:
        if s.optional and s.name not in values:
            values[s.name] = None
    body = dict(values.get("model") or {})
    new = {"path": model}
    if revision is not None:
        new["revision"] = revision
    values["model"] = {**new, **{k: v for k, v in body.items() if k not in new}}
    return commented_recipe(values, split_header(text))


if __name__ == "__main__":  # python -m ftkit.recipe.scaffold templates/*.yaml  (make templates)
    import sys
    from pathlib import Path

    for arg in sys.argv[1:]:
        p = Path(arg)
        p.write_text(regenerated(p.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"regenerated {p}")
