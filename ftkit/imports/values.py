"""Typed reading of one source value: numbers written as ``2e8`` or ``"1e9"``, booleans written as ``"true"``.

Each helper returns the value in ftkit's type, or records one problem on the sink (file, key, what is wrong) and
returns None, so a malformed source ends with one line per bad value, never a traceback.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ftkit.imports.mapping import Sink

AUTO = "auto"


def is_auto(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"number {value}"
    if isinstance(value, str):
        return f"text {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "nothing" if value is None else type(value).__name__


def to_float(sink: Sink, key: str, value: object, minimum: float | None = None) -> float | None:
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        sink.problem(key, f"expected a number, got {_describe(value)}")
        return None
    if minimum is not None and number < minimum:
        sink.problem(key, f"must be at least {minimum:g}; got {number:g}")
        return None
    return number


def to_int(sink: Sink, key: str, value: object, minimum: int | None = 0) -> int | None:
    """An integer, also from a float literal such as 2e8 or 5.0e8 (JSON and YAML write bucket sizes that way)."""
    number = to_float(sink, key, value) if not isinstance(value, bool) else None
    if isinstance(value, bool):
        sink.problem(key, f"expected an integer, got {_describe(value)}")
        return None
    if number is None:
        return None
    if not number.is_integer():
        sink.problem(key, f"expected an integer, got {value}")
        return None
    if minimum is not None and number < minimum:
        sink.problem(key, f"must be at least {minimum}; got {int(number)}")
        return None
    return int(number)


def to_bool(sink: Sink, key: str, value: object) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    sink.problem(key, f"expected true or false, got {_describe(value)}")
    return None


def to_str(sink: Sink, key: str, value: object) -> str | None:
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    sink.problem(key, f"expected text, got {_describe(value)}")
    return None


def to_mapping(sink: Sink, key: str | None, value: object) -> Mapping[str, object] | None:
    """The value when it is a mapping (keys as the file writes them), else one problem and None."""
    if isinstance(value, dict):
        return value
    sink.problem(key, f"expected a mapping of settings, got {_describe(value)}")
    return None


def unset(value: object) -> bool:
    """YAML's empty value, or an empty string/list/mapping: the key is there but says nothing."""
    return value is None or (isinstance(value, (str, list, dict)) and not value)
