"""Load, override and validate a recipe.

Precedence, stated once: **command-line ``key=value`` > recipe file > defaults.** A value given on the command
line replaces the file's value for that key; a key absent from both takes the default declared in
:mod:`ftkit.recipe.schema`. (Pinned by ``tests/recipe/test_recipe.py::test_precedence``.)

Every problem is collected before anything fails, each reported as ``FILE:LINE KEY: problem`` with the fix, and
raised once as :class:`ftkit.errors.RecipeError` (exit 2, no traceback). Each resolved value remembers where it
came from (``recipe.yaml:14``, ``command line``, ``default``) so ``ftkit explain`` can say why.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import yaml

from ftkit.errors import Problem, RecipeError
from ftkit.model.config import is_hub_id
from ftkit.recipe.rules import backend_problems, offload_problems, parallel_problems, scheduler_problems
from ftkit.recipe.schema import FIELD_BY_KEY, SECTION_BY_NAME, SECTIONS, TOP_LEVEL, Field, Value
from ftkit.rundir.env import mask_items
from ftkit.rundir.records import JSON, JSONObject
from ftkit.rundir.sections import (
    CheckpointSection,
    ClusterSection,
    DataSection,
    FsdpSection,
    ModelSection,
    ParallelSection,
    PeftSection,
    ResilienceSection,
    SchedulerSection,
    TrainSection,
    ZeroSection,
)

try:  # the C loader is ~10x faster; fall back quietly where libyaml is missing
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

CLI = "command line"
DEFAULT = "default"

# Limits that keep a hostile or mistaken file from costing more than milliseconds: a recipe is a few KiB with a
# few dozen keys. YAML aliases are allowed (``<<: *defaults``) but every use counts the aliased nodes again, so a
# "billion laughs" file (a few hundred bytes expanding to 10^9 nodes) is refused before it is composed.
MAX_RECIPE_BYTES = 1 << 20
HUB_KEYS = ("model.path", "model.tokenizer")  # path fields that may instead name a hub id (org/name)
MAX_YAML_NODES = 10_000  # nodes after expanding aliases
MAX_YAML_DEPTH = 32  # nesting depth (libyaml's composer recurses on the C stack: 100k levels crash it)

_Section = TypeVar("_Section")


def _json(value: Value) -> JSON:
    return [*value] if isinstance(value, list) else value


@dataclass
class Recipe:
    """A validated recipe: ``values`` holds every field by dotted key, ``sources`` where each came from."""

    path: Path | None
    values: dict[str, Value]
    sources: dict[str, str]
    has_peft: bool
    explicit: set[str] = field(default_factory=set)  # keys given in the file or on the command line

    def __getitem__(self, key: str) -> Value:
        """By dotted key, for the loader and the generic tools of this folder (explain, scaffold); code elsewhere
        reads the typed sections (``recipe.train.save_steps``)."""
        return self.values[key]

    def get(self, key: str, default: Value = None) -> Value:
        return self.values.get(key, default)

    def _section(self, name: str, cls: type[_Section]) -> _Section:
        fields = SECTION_BY_NAME[name].fields
        return cls(**{f.name: self.values.get(f"{name}.{f.name}") for f in fields})

    @property
    def name(self) -> str:
        return str(self.values["name"])

    @property
    def model(self) -> ModelSection:
        return self._section("model", ModelSection)

    @property
    def peft(self) -> PeftSection | None:
        """None for full fine-tuning (the section is absent)."""
        return self._section("peft", PeftSection) if self.has_peft else None

    @property
    def data(self) -> DataSection:
        return self._section("data", DataSection)

    @property
    def train(self) -> TrainSection:
        return self._section("train", TrainSection)

    @property
    def scheduler(self) -> SchedulerSection:
        return self._section("scheduler", SchedulerSection)

    @property
    def checkpoint(self) -> CheckpointSection:
        return self._section("checkpoint", CheckpointSection)

    @property
    def zero(self) -> ZeroSection:
        return self._section("zero", ZeroSection)

    @property
    def fsdp(self) -> FsdpSection:
        return self._section("fsdp", FsdpSection)

    @property
    def parallel(self) -> ParallelSection:
        return self._section("parallel", ParallelSection)

    @property
    def cluster(self) -> ClusterSection:
        return self._section("cluster", ClusterSection)

    @property
    def resilience(self) -> ResilienceSection:
        return self._section("resilience", ResilienceSection)

    def where(self, key: str) -> tuple[str | None, int | None]:
        """(file, line) where ``key`` was set: the recipe file and line, the command line, or the file alone."""
        src = self.sources.get(key, DEFAULT)
        if src == CLI:
            return CLI, None
        if src != DEFAULT and ":" in src:
            file, _, line = src.rpartition(":")
            return file, int(line) if line.isdigit() else None
        return (str(self.path) if self.path else None), None

    def problem(self, key: str, message: str) -> Problem:
        file, line = self.where(key)
        return Problem(message, file=file, line=line, key=key)

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    def to_dict(self) -> JSONObject:
        """The resolved recipe as nested data (paths absolute), the form written into the run directory."""
        out: JSONObject = {f.name: _json(self.values[f.name]) for f in TOP_LEVEL}
        for s in SECTIONS:
            if s.name == "peft" and not self.has_peft:
                out["peft"] = None
                continue
            if s.name == "parallel" and all(self.values[f"parallel.{f.name}"] == f.default for f in s.fields):
                continue  # data parallelism only: the record (and the recipe's hash) as before the section existed
            out[s.name] = {f.name: _json(self.values[f"{s.name}.{f.name}"]) for f in s.fields}
        cluster, env = out.get("cluster"), self.values.get("cluster.env")
        if isinstance(cluster, dict) and isinstance(env, list):  # secrets never reach a record
            cluster["env"] = list[JSON](mask_items(env))
        return out

    def hash(self) -> str:
        """A stable hash of the resolved recipe: ties checkpoints and rendered configs to the recipe."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Reading YAML with line numbers


@dataclass
class _Open:
    """A YAML collection not closed yet: its nodes so far (aliases expanded) and its anchor."""

    count: int
    anchor: str | None


def _yaml_limits(text: str, filename: str) -> None:
    """Refuse alias bombs, recursive aliases and deep nesting from the event stream, before anything is composed.

    Counts the nodes the document would have once every alias is expanded (an alias counts its anchor's whole
    subtree again): linear in the file's size, so a bomb is refused in milliseconds.
    """
    sizes: dict[str, int] = {}  # anchor -> expanded node count of its (finished) subtree
    stack: list[_Open] = []  # open collections
    total = 0
    try:
        for ev in yaml.parse(text, Loader=_Loader):
            line = ev.start_mark.line + 1 if ev.start_mark else None
            if isinstance(ev, yaml.AliasEvent):
                if any(o.anchor == ev.anchor for o in stack):
                    raise RecipeError(
                        Problem(f"recursive YAML alias *{ev.anchor} (it refers to itself)", file=filename, line=line)
                    )
                n = sizes.get(ev.anchor, 1) if ev.anchor is not None else 1
            elif isinstance(ev, yaml.ScalarEvent):
                n = 1
                if ev.anchor:
                    sizes[ev.anchor] = 1
            elif isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                stack.append(_Open(1, ev.anchor))
                if len(stack) > MAX_YAML_DEPTH:
                    raise RecipeError(
                        Problem(
                            f"nested deeper than {MAX_YAML_DEPTH} levels (a recipe is flat)", file=filename, line=line
                        )
                    )
                n = 1
            elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                done = stack.pop()
                if done.anchor:
                    sizes[done.anchor] = done.count
                if stack:
                    stack[-1].count += done.count
                continue
            else:
                continue
            if stack and not isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                stack[-1].count += n
            total += n
            if total > MAX_YAML_NODES:
                raise RecipeError(
                    Problem(
                        f"YAML expands to more than {MAX_YAML_NODES} values (aliases like *{ev.anchor or 'x'} "
                        "repeat whole subtrees: an alias bomb?); write the values out",
                        file=filename,
                        line=line,
                    )
                )
    except yaml.YAMLError:
        return  # composing reports the syntax error with its line


def _compose(text: str, filename: str) -> yaml.Node | None:
    _yaml_limits(text, filename)
    try:
        return yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        what = (e.problem or str(e)).strip()
        raise RecipeError(Problem(f"invalid YAML: {what}", file=filename, line=line)) from None
    except yaml.YAMLError as e:
        raise RecipeError(Problem(f"invalid YAML: {e}", file=filename)) from None


def _to_python(node: yaml.Node) -> object:
    """Construct plain Python data from a composed node (safe constructors only)."""
    loader = _Loader("")
    try:
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _walk(node: yaml.Node, prefix: str, lines: dict[str, int], dups: list[tuple[str, int, int]]) -> None:
    """Record the line of every key (dotted) and collect duplicate keys as (key, first line, second line)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = f"{prefix}{k.value}" if isinstance(k, yaml.ScalarNode) else f"{prefix}?"
            line = k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if key in seen:
                    dups.append((key, seen[key], line))
                seen[key] = line
            lines[key] = line
            _walk(v, key + ".", lines, dups)


# ---------------------------------------------------------------------------------------------------------------
# Type coercion: one place decides what a value of each declared type may be


def _coerce(f: Field, value: object) -> tuple[Value, str | None]:
    """Return (value, None) when ``value`` fits the field's type, else (None, problem)."""
    kinds = f.type.split("|")
    if value is None:
        if "null" in kinds:
            return None, None
        return None, f"must not be empty (expected {f.type_label()})"
    if isinstance(value, str) and value == "auto" and "auto" in kinds:
        return "auto", None
    if isinstance(value, str) and ("float" in kinds or "int" in kinds):
        # YAML 1.1 reads 2e-4 and 5e8 (no dot) as text; people write them anyway.
        try:
            value = float(value)
        except ValueError:
            pass
    for kind in kinds:
        if kind == "bool" and isinstance(value, bool):
            return value, None
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value, None
        if kind == "int" and isinstance(value, float) and value.is_integer() and abs(value) >= 1e3:
            return int(value), None  # allow 5e8 for bucket sizes
        if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                return None, f"must be a finite number; got {value}"
            return float(value), None
        if kind in ("str", "path") and isinstance(value, str) and value:
            return value, None
        if kind == "host" and isinstance(value, str) and value:
            return value, None
        if kind == "choice" and isinstance(value, str) and value in f.choices:
            return value, None
        if kind == "list[str]" and isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            return list(value), None
        if kind == "list[choice]" and isinstance(value, list) and all(isinstance(x, str) for x in value):
            bad = [x for x in value if x not in f.choices]
            if bad:
                hint = _suggest(bad[0], f.choices)
                return None, f"items must be among {', '.join(f.choices)}; got {bad[0]!r}{hint}"
            return list(value), None
    if value == [] and "list[str]" in kinds:
        return None, "must list at least one item" + (" (null: none)" if "null" in kinds else "")
    if "choice" in kinds:
        hint = _suggest(str(value), f.choices)
        return None, f"must be one of {', '.join(f.choices)}; got {value!r}{hint}"
    return None, f"expected {f.type_label()}, got {_describe(value)}"


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return f"boolean {value}"
    if isinstance(value, (int, float)):
        return f"number {value}"
    if isinstance(value, str):
        return f"text {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _bounds(f: Field, value: Value) -> str | None:
    if isinstance(value, str):
        return _text_problem(f, value)
    if isinstance(value, list) and "list[str]" in f.type.split("|"):
        if not value[0].strip():
            return "the first word must not be empty (it names the program)"
        for i, item in enumerate(value):
            problem = _text_problem(f, item)
            if problem:
                return f"item {i + 1}: {problem}"
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if f.exclusive_minimum is not None and not value > f.exclusive_minimum:
        return f"must be greater than {_num(f.exclusive_minimum)}; got {_num(value)}"
    if f.minimum is not None and value < f.minimum:
        return f"must be at least {_num(f.minimum)}; got {_num(value)}"
    if f.maximum is not None and value > f.maximum:
        return f"must be at most {_num(f.maximum)}; got {_num(value)}"
    if f.exclusive_maximum is not None and not value < f.exclusive_maximum:
        return f"must be less than {_num(f.exclusive_maximum)}; got {_num(value)}"
    return None


def _text_problem(f: Field, value: str) -> str | None:
    """Grammar of text values that reach command lines (and, through engines, remote shells)."""
    if value == "auto" and "auto" in f.type.split("|"):
        return None
    if "host" in f.type.split("|"):
        return host_problem(value)
    if f.pattern and not re.fullmatch(f.pattern, value):
        return f"{f.pattern_doc or 'must match ' + f.pattern}; got {value!r}"
    return None


_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host_problem(value: str) -> str | None:
    """None when ``value`` is a host name (RFC 1123 labels) or an IPv4/IPv6 literal, else what is wrong."""
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    name = value[:-1] if value.endswith(".") else value  # a fully qualified name may end with a dot
    labels = name.split(".")
    if (
        0 < len(name) <= 253
        and all(_LABEL.fullmatch(label) for label in labels)
        and not all(label.isdigit() for label in labels)  # 999.1.1.1 is a broken IP, not a name
    ):
        return None
    return (
        f"must be a host name (letters, digits, '-' and '.') or an IP address; got {value!r}"
        " (quotes, spaces, '$', ';' and backticks are never part of an address)"
    )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _suggest(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------------------------------------------
# Overrides


def parse_override(text: str) -> tuple[str, object]:
    """Split ``key=value``; the value is read as YAML so ``8``, ``true``, ``null``, ``[a, b]`` get their types."""
    if "=" not in text:
        raise RecipeError(Problem(f"override {text!r} is not KEY=VALUE (e.g. zero.stage=3)", file=CLI))
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise RecipeError(Problem(f"override {text!r} has no key", file=CLI))
    if len(raw) > 65536:
        raise RecipeError(Problem(f"override {key}: value longer than 64 KiB", file=CLI, key=key))
    try:
        _yaml_limits(raw, CLI)
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except RecipeError as e:
        raise RecipeError([Problem(p.message, file=CLI, key=key) for p in e.problems]) from None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        try:  # YAML 1.1 reads 2e-4 (no dot) as text
            value = float(value) if any(c.isdigit() for c in value) else value
        except ValueError:
            pass
    return key, value


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_recipe(path: str | os.PathLike[str] | None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read ``path`` (or nothing, for defaults only), apply ``key=value`` overrides, validate everything.

    Precedence: command line > file > defaults. Raises RecipeError listing every problem found.
    """
    problems: list[Problem] = []
    raw: dict[object, object] = {}
    lines: dict[str, int] = {}
    filename = str(path) if path is not None else "<no recipe>"
    rpath: Path | None = None
    if path is not None:
        rpath = Path(path)
        try:
            with open(rpath, "rb") as fh:  # read at most the cap (+1 to notice more): never a huge file or a pipe
                blob = fh.read(MAX_RECIPE_BYTES + 1)
            text = blob.decode("utf-8")
        except FileNotFoundError:
            raise RecipeError(Problem("recipe file not found", file=filename)) from None
        except IsADirectoryError:
            raise RecipeError(Problem("is a directory, expected a recipe YAML file", file=filename)) from None
        except OSError as e:
            raise RecipeError(Problem(f"cannot read recipe: {e.strerror or e}", file=filename)) from None
        except UnicodeDecodeError as e:
            raise RecipeError(Problem(f"cannot read recipe: not UTF-8 text ({e.reason})", file=filename)) from None
        if len(blob) > MAX_RECIPE_BYTES:
            raise RecipeError(
                Problem(
                    f"larger than {MAX_RECIPE_BYTES >> 20} MiB: a recipe is a few KiB of settings; is this the right "
                    "file?",
                    file=filename,
                )
            )
        node = _compose(text, filename)
        if node is not None:
            dups: list[tuple[str, int, int]] = []
            _walk(node, "", lines, dups)
            for key, first, again in dups:
                problems.append(
                    Problem(
                        f"duplicate key (also set at line {first}); YAML would silently keep the last one: remove one",
                        file=filename,
                        line=again,
                        key=key,
                    )
                )
            try:
                data = _to_python(node)
            except yaml.YAMLError as e:
                raise RecipeError(Problem(f"invalid YAML: {e}", file=filename)) from None
            if not isinstance(data, dict):
                raise RecipeError(
                    Problem(
                        "the recipe must be a mapping of sections (model:, data:, train: ...)", file=filename, line=1
                    )
                )
            raw = data

    def where(key: str) -> Problem:
        return Problem("", file=filename, line=lines.get(key), key=key)

    def add(key: str, message: str, source: str | None = None) -> None:
        if source == CLI:
            problems.append(Problem(message, file=CLI, key=key))
        else:
            w = where(key)
            problems.append(Problem(message, file=w.file, line=w.line, key=key))

    # Flatten the file into dotted keys, rejecting unknown sections and keys with a suggestion.
    given: dict[str, tuple[object, str]] = {}
    top_names = [f.name for f in TOP_LEVEL]
    has_peft = False
    for raw_key, value in raw.items():
        key = str(raw_key)
        if key in top_names:
            given[key] = (value, f"{filename}:{lines.get(key, '?')}")
            continue
        section = SECTION_BY_NAME.get(key)
        if section is None:
            add(
                key,
                f"unknown section{_suggest(key, [*SECTION_BY_NAME, *top_names])}; "
                f"sections are {', '.join(SECTION_BY_NAME)}",
            )
            continue
        if value is None and section.optional:
            continue
        if not isinstance(value, dict):
            add(key, f"must be a mapping of {section.name} settings, got {_describe(value)}")
            continue
        if section.name == "peft":
            has_peft = True
        for sub, v in value.items():
            dotted = f"{key}.{sub}"
            if section.get(str(sub)) is None:
                add(
                    dotted,
                    f"unknown key{_suggest(str(sub), section.names)}; {section.name} has {', '.join(section.names)}",
                )
                continue
            given[dotted] = (v, f"{filename}:{lines.get(dotted, '?')}")

    # Apply command-line overrides on top (they win).
    for text in overrides:
        try:
            key, value = parse_override(text)
        except RecipeError as e:
            problems.extend(e.problems)
            continue
        sec_name, _, sub = key.partition(".")
        if key in top_names:
            given[key] = (value, CLI)
            continue
        section = SECTION_BY_NAME.get(sec_name)
        if section is None or not sub:
            known = [k for s in SECTIONS for k in (f"{s.name}.{f.name}" for f in s.fields)] + top_names
            add(key, f"unknown key{_suggest(key, known)}", CLI)
            continue
        if section.get(sub) is None:
            add(key, f"unknown key{_suggest(sub, section.names)}; {section.name} has {', '.join(section.names)}", CLI)
            continue
        if section.name == "peft":
            has_peft = True
        given[key] = (value, CLI)

    # Resolve every field: given value (typed, bounded) or default.
    values: dict[str, Value] = {}
    sources: dict[str, str] = {}
    explicit: set[str] = set()
    for f in TOP_LEVEL:
        _resolve(f.name, f, given, values, sources, explicit, add)
    for s in SECTIONS:
        for f in s.fields:
            key = f"{s.name}.{f.name}"
            if s.name == "peft" and not has_peft:
                values[key] = f.default_value
                sources[key] = DEFAULT
                continue
            _resolve(key, f, given, values, sources, explicit, add, section_line=lines.get(s.name))

    # Paths: relative to the recipe's directory when from the file, to the current directory from the command line.
    base = rpath.parent if rpath else Path.cwd()
    for key, value in list(values.items()):
        fld = _field(key)
        if fld and "path" in fld.type.split("|") and isinstance(value, str):
            if value == "auto" and "auto" in fld.type.split("|"):
                continue  # ftkit decides (checkpoint.local_dir: auto)
            anchor = Path.cwd() if sources.get(key) == CLI else base
            if key in HUB_KEYS and is_hub_id(value, anchor):
                continue  # org/name with no such local directory: a hub id, resolved by ftkit.model.config
            values[key] = str((anchor / os.path.expanduser(value)).resolve()) if "://" not in value else value

    recipe = Recipe(path=rpath, values=values, sources=sources, has_peft=has_peft, explicit=explicit)
    if not problems:
        _cross_checks(recipe, add)
    if problems:
        raise RecipeError(problems)
    return recipe


class _Add(Protocol):
    """Records a problem with ``key`` (``source``: CLI when the value came from the command line)."""

    def __call__(self, key: str, message: str, source: str | None = None) -> None: ...


def _field(key: str) -> Field | None:

    return FIELD_BY_KEY.get(key)


def _resolve(
    key: str,
    f: Field,
    given: dict[str, tuple[object, str]],
    values: dict[str, Value],
    sources: dict[str, str],
    explicit: set[str],
    add: _Add,
    section_line: int | None = None,
) -> None:
    if key in given:
        value, source = given[key]
        coerced, problem = _coerce(f, value)
        if problem is None:
            problem = _bounds(f, coerced)
        if problem:
            add(key, problem, CLI if source == CLI else None)
            values[key] = f.default_value
        else:
            values[key] = coerced
        sources[key] = source
        explicit.add(key)
        return
    if f.required:
        section = key.split(".")[0]
        add(key, f"required; add it under '{section}:' ({f.doc})")
        values[key] = None
        sources[key] = DEFAULT
        return
    values[key] = f.default_value
    sources[key] = DEFAULT


def _cross_checks(r: Recipe, add: _Add) -> None:
    """Rules that involve more than one field. World-size rules live in :mod:`ftkit.plan.plan` (they need the
    hostfile)."""

    def src(key: str) -> str | None:
        return CLI if r.sources.get(key) == CLI else None

    v = r.values  # written where the checks resolve a value (the engine; auto's open ZeRO side)
    train, zero, cluster, model = r.train, r.zero, r.cluster, r.model
    if train.backend != "fsdp2":
        for key, problem in offload_problems(zero.stage, zero.offload_optimizer, zero.offload_params):
            add(key, problem, src(key))
    uses_nvme = "nvme" in (zero.offload_optimizer, zero.offload_params)
    if uses_nvme and not zero.nvme_path:
        add("zero.nvme_path", "required when offloading to nvme: a local NVMe directory", src("zero.nvme_path"))
    if train.max_steps is None and train.epochs is None:
        add("train.max_steps", "set train.max_steps or train.epochs", src("train.max_steps"))
    if (
        train.max_steps is not None
        and train.epochs is not None
        and "train.epochs" in r.explicit
        and "train.max_steps" in r.explicit
    ):
        add(
            "train.epochs",
            "set only one of train.max_steps and train.epochs (max_steps: null to use epochs)",
            src("train.epochs"),
        )
    if train.global_batch_size % train.micro_batch_size != 0:
        add(
            "train.global_batch_size",
            f"{train.global_batch_size} is not a multiple of train.micro_batch_size {train.micro_batch_size}",
            src("train.global_batch_size"),
        )
    if cluster.min_nodes is not None and cluster.hostfile is None and cluster.min_nodes > cluster.num_nodes:
        add(
            "cluster.min_nodes",
            f"{cluster.min_nodes} is more than cluster.num_nodes {cluster.num_nodes}",
            src("cluster.min_nodes"),
        )
    fsdp2 = train.backend in ("fsdp2", "auto")  # auto may choose fsdp2: both run under accelerate
    for key, problem in backend_problems(v, r.explicit):
        add(key, problem, src(key))
    for key, problem in scheduler_problems(v, r.explicit):
        add(key, problem, src(key))
    for key, problem in parallel_problems(v):
        add(key, problem, src(key))
    if cluster.engine == "auto" or (fsdp2 and "cluster.engine" not in r.explicit):
        # resolved once, here, so every reader sees the engine that will run; FSDP2 runs under accelerate
        v["cluster.engine"] = "slurm" if os.environ.get("SLURM_JOB_ID") else ("accelerate" if fsdp2 else "deepspeed")
    if train.backend == "auto":  # the ZeRO side is as open as the recipe leaves it
        for key in ("zero.stage", "zero.offload_optimizer"):
            if key not in r.explicit:
                v[key] = "auto"
    if v["cluster.engine"] == "slurm" and cluster.hostfile is not None:
        add(
            "cluster.hostfile",
            "not used with engine slurm: the Slurm allocation gives the hosts; remove cluster.hostfile",
            src("cluster.hostfile"),
        )
    if cluster.accelerator == "cpu" and train.precision == "fp16":
        add("train.precision", "fp16 is not supported on the cpu accelerator; use bf16 or fp32", src("train.precision"))
    if model.revision is not None and model.path and os.path.isabs(model.path):
        add(
            "model.revision",
            f"applies to a hub id only; model.path is a local directory ({model.path}): remove model.revision",
            src("model.revision"),
        )
    if "none" in train.report_to and len(train.report_to) > 1:
        add(
            "train.report_to",
            "'none' cannot be combined with other targets; use [] or drop 'none'",
            src("train.report_to"),
        )
    peft = r.peft
    if peft is not None and peft.dropout is not None and peft.dropout >= 1:
        add("peft.dropout", "must be below 1", src("peft.dropout"))
