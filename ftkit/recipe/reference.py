"""The recipe reference (Markdown) and JSON Schema, both generated from :mod:`ftkit.recipe.schema` so they cannot
drift."""

from __future__ import annotations

from ftkit.recipe.scaffold import format_value
from ftkit.recipe.schema import REQUIRED, SECTIONS, TOP_LEVEL, Field


def _json_type(f: Field) -> dict[str, object]:
    options: list[dict[str, object]] = []
    for kind in f.type.split("|"):
        if kind == "int":
            t: dict[str, object] = {"type": "integer"}
        elif kind == "float":
            t = {"type": "number"}
        elif kind == "bool":
            t = {"type": "boolean"}
        elif kind in ("str", "path"):
            t = {"type": "string", "minLength": 1}
            if f.pattern:
                t["pattern"] = f"^{f.pattern}$"
        elif kind == "host":
            t = {"type": "string", "anyOf": [{"format": "hostname"}, {"format": "ipv4"}, {"format": "ipv6"}]}
        elif kind == "choice":
            t = {"enum": list(f.choices)}
        elif kind == "list[str]":
            items: dict[str, object] = {"type": "string"}
            if f.pattern:
                items["pattern"] = f"^{f.pattern}$"
            t = {"type": "array", "items": items, "minItems": 1}
        elif kind == "list[choice]":
            t = {"type": "array", "items": {"enum": list(f.choices)}}
        elif kind == "auto":
            t = {"const": "auto"}
        elif kind == "null":
            t = {"type": "null"}
        else:  # pragma: no cover - every kind in schema.py is handled above
            raise ValueError(kind)
        if kind in ("int", "float"):
            if f.minimum is not None:
                t["minimum"] = f.minimum
            if f.exclusive_minimum is not None:
                t["exclusiveMinimum"] = f.exclusive_minimum
            if f.maximum is not None:
                t["maximum"] = f.maximum
            if f.exclusive_maximum is not None:
                t["exclusiveMaximum"] = f.exclusive_maximum
        options.append(t)
    out: dict[str, object] = options[0] if len(options) == 1 else {"anyOf": options}
    out = dict(out)
    out["description"] = f.doc
    if f.default is not REQUIRED:
        out["default"] = f.default
    return out


def json_schema() -> dict[str, object]:
    props: dict[str, object] = {f.name: _json_type(f) for f in TOP_LEVEL}
    required: list[str] = []
    for s in SECTIONS:
        sec: dict[str, object] = {
            "type": "object",
            "description": s.doc,
            "additionalProperties": False,
            "properties": {f.name: _json_type(f) for f in s.fields},
        }
        req = [f.name for f in s.fields if f.required]
        if req:
            sec["required"] = req
            required.append(s.name)
        props[s.name] = {"anyOf": [sec, {"type": "null"}]} if s.optional else sec
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "ftkit recipe",
        "type": "object",
        "additionalProperties": False,
        "properties": props,
        "required": required,
    }


def markdown_reference() -> str:
    lines = [
        "# Recipe reference",
        "",
        "Generated from `ftkit/recipe/schema.py` by `ftkit schema --markdown`; a test fails when this file is stale.",
        "Precedence: command-line `key=value` > recipe file > defaults. Relative paths in the file are relative to",
        "the recipe's directory; on the command line, to the current directory.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for f in TOP_LEVEL:
        lines.append(_row(f.name, f))
    for s in SECTIONS:
        lines += [
            "",
            f"## `{s.name}`" + (" (optional section)" if s.optional else ""),
            "",
            s.doc,
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        lines += [_row(f"{s.name}.{f.name}", f) for f in s.fields]
    return "\n".join(lines) + "\n"


def _row(key: str, f: Field) -> str:
    default = "*required*" if f.default is REQUIRED else f"`{format_value(f.default)}`"
    return f"| `{key}` | {f.type_label().replace('|', ' or ')} | {default} | {f.doc} |"
