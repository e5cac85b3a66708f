"""``ftkit import``: read every source (and the files they name), resolve, refuse or accept, write one recipe.

:func:`import_configs` is the one library call the CLI makes. Nothing is written here: the caller writes
:attr:`ImportResult.recipe_text` (all or nothing). The recipe is checked by ftkit's own loader before it is
returned, so what ``ftkit import`` writes always loads.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ftkit import __version__
from ftkit.cluster.hostfile import parse_hostfile
from ftkit.errors import Problem, RecipeError, UserError
from ftkit.imports import accelerate, axolotl, deepspeed, llamafactory, trainer_args
from ftkit.imports.adopt import plan_lines
from ftkit.imports.mapping import (
    ACCUM,
    AUTO,
    BF16,
    DEFAULT,
    FP16,
    GLOBAL,
    HARD,
    MAPPED,
    MICRO,
    NO_EFFECT,
    NODES,
    REFUSED,
    WORLD,
    Claim,
    Report,
    Sink,
    _accepted,
    fmt,
)
from ftkit.imports.read import Loaded, load
from ftkit.model.config import hub_config_file, looks_like_hub_id
from ftkit.model.shape import hidden_size, load_config_file, load_model_config
from ftkit.recipe.load import load_recipe
from ftkit.recipe.scaffold import commented_recipe
from ftkit.recipe.schema import REQUIRED, SECTIONS, TOP_LEVEL, Default

READERS: dict[str, Callable[[Sink, Loaded, Context], None]] = {
    "deepspeed": lambda sink, loaded, ctx: deepspeed.read(sink, loaded.data),
    "accelerate": lambda sink, loaded, ctx: accelerate.read(sink, loaded.mapping(), ctx),
    "trainer": lambda sink, loaded, ctx: trainer_args.read(sink, loaded.data, ctx),
    "axolotl": lambda sink, loaded, ctx: axolotl.read(sink, loaded.data, ctx),
    "llamafactory": lambda sink, loaded, ctx: llamafactory.read(sink, loaded.data, ctx),
}
KIND_NAMES = {
    "deepspeed": "DeepSpeed config",
    "accelerate": "Accelerate config",
    "trainer": "TrainingArguments",
    "axolotl": "Axolotl config",
    "llamafactory": "LLaMA-Factory config",
}
DEFAULT_CLUSTER = (1, 8)  # ftkit's default cluster.num_nodes x cluster.gpus_per_node
PLACEHOLDERS = {
    "model.path": "./model",
    "data.train": "./data/train.jsonl",
}


@dataclass
class ImportResult:
    recipe_text: str
    report: Report
    lines: list[str]  # the mapping report, one line per source key (and per value no source states)
    sources: list[str]
    placeholders: list[str] = field(default_factory=list)  # recipe keys to fill in by hand
    accepted: list[str] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)  # --plan: ftkit's planner against the sources' choice


class Context:
    """What readers need beyond their own file: following referenced files, hostfiles, path rebasing."""

    def __init__(self, report: Report, out_dir: Path, cwd: Path):
        self.report = report
        self.out_dir = out_dir
        self.cwd = cwd
        self.queue: list[tuple[str, str | None, str | None]] = []  # (path, kind or None to detect, label)
        self.seen: dict[str, str] = {}  # real path -> label
        self.sources: list[str] = []
        self.current_dir: Path | None = None  # the directory of the source being read (references resolve there too)

    def resolve_path(self, text: str, base: Path | None) -> Path | None:
        path = Path(os.path.expanduser(text))
        if path.is_absolute():
            return path if path.exists() else None
        for root in (self.cwd, base):
            if root is not None and (root / path).exists():
                return root / path
        return None

    def follow(self, sink: Sink, key: str, text: str, kind: str) -> None:
        base = self.current_dir
        path = self.resolve_path(text, base)
        if path is None:
            where = f"{self.cwd}" + (f" and {base}" if base and base != self.cwd else "")
            sink.problem(key, f"{text}: not found (looked in {where}); pass it as a source or fix the path")
            return
        real = os.path.realpath(path)
        if real in self.seen:
            sink.followed(key, f"{text} (read as {self.seen[real]})")
            return
        article = "an" if KIND_NAMES[kind][0] in "AEIOU" else "a"
        sink.followed(key, f"{text} as {article} {KIND_NAMES[kind]} (its keys are listed under its name)")
        self.queue.append((str(path), kind, text))

    def hostfile(self, sink: Sink, key: str, text: str) -> None:

        path = self.resolve_path(text, self.current_dir)
        if path is None:
            sink.problem(key, f"hostfile {text}: not found")
            return
        hf = parse_hostfile(path)
        sink.map(key, "cluster.hostfile", self.path_value(str(path)), "its slots give the world size")
        sink.map(key, WORLD, hf.world_size, f"{hf.num_nodes} host(s), {hf.world_size} slots")
        sink.map(key, NODES, hf.num_nodes)

    def inline_deepspeed(self, sink: Sink, key: str, value: Mapping[str, object]) -> None:
        sink.followed(key, "an inline DeepSpeed config (its keys are listed under it)")
        deepspeed.read(self.report.sink(f"{sink.source} {key}"), value)

    def inline_plugin(self, sink: Sink, ds: Mapping[str, object]) -> None:
        """Accelerate's DeepSpeed plugin without a config file: zero_stage defaults to 2, the rest is "auto"."""
        if "zero_stage" not in ds:
            sink.implied("deepspeed_config.zero_stage", "zero.stage", 2, "Accelerate's default zero_stage 2")
        stage = ds.get("zero_stage", 2)
        stage = stage if isinstance(stage, int) and 0 <= stage <= 3 else 2
        offload = {
            "offload_optimizer": {"device": str(ds.get("offload_optimizer_device", "none"))},
            "offload_param": {"device": str(ds.get("offload_param_device", "none"))},
        }
        deepspeed.absent_defaults(sink, offload, stage, prefix="deepspeed_config")
        if "gradient_accumulation_steps" not in ds:
            sink.auto("deepspeed_config.gradient_accumulation_steps (absent)", ACCUM)
        if "gradient_clipping" not in ds:
            sink.auto("deepspeed_config.gradient_clipping (absent)", "train.max_grad_norm")

    def path_value(self, text: str, hub: bool = False) -> str:
        """A path as a source wrote it (relative to where the run started: here) as the recipe needs it (relative
        to the recipe's directory); a hub id (org/name with no such directory) stays as it is."""

        path = Path(os.path.expanduser(text))
        if hub and not path.is_absolute() and looks_like_hub_id(text) and not (self.cwd / path).exists():
            return text
        full = path if path.is_absolute() else self.cwd / path
        rel = os.path.relpath(full.resolve(), self.out_dir.resolve())
        if rel == ".":
            return rel
        if not rel.startswith(".."):
            return f"./{rel}"
        ups = len(Path(rel).parts) - len(Path(rel.replace("../", "")).parts)
        return rel if ups <= 2 and not path.is_absolute() else str(full.resolve())

    def world_named(self) -> bool:
        return any(c.target == WORLD for c in self.report.claims)


def import_configs(
    sources: Sequence[str],
    *,
    model: str | None = None,
    hostfile: str | None = None,
    accept: Sequence[str] = (),
    out: Path | None = None,
    cwd: Path | None = None,
    plan: bool = False,
) -> ImportResult:
    """Read ``sources`` (and the files they name), map every key, resolve, and return the recipe text with its
    report (``plan``: and what ftkit's planner would choose against the sources' choice). Raises UserError (exit 2,
    one line per problem or refused key) when the sources are malformed, disagree, set something that changes
    training and is not in ``accept``, or state a value the recipe cannot hold (named at its source line)."""
    cwd = cwd or Path.cwd()
    report, ctx = read_sources(sources, model=model, hostfile=hostfile, out=out, cwd=cwd)
    fsdp2 = any(c.target == "train.backend" and c.value == "fsdp2" for c in report.claims)
    if not fsdp2 and not any(c.target == "zero.stage" for c in report.claims):
        report.values["zero.stage"] = 0
        report.notes.append(
            "zero.stage = 0: no source configures DeepSpeed, so HF Trainer runs DDP: DeepSpeed without ZeRO is the "
            "same data-parallel update"
        )
    report.resolve(DEFAULT_CLUSTER)
    accepted = {a.strip() for item in accept for a in item.split(",") if a.strip()}
    _stop_if_refused(report, accepted)
    values, placeholders = _recipe_values(report, ctx)
    text = _recipe_text(values, ctx.sources, report, accepted, placeholders)
    _validate(text, out, report)
    planned = plan_lines(text, ctx.out_dir) if plan else []
    return ImportResult(text, report, report.lines(accepted), ctx.sources, placeholders, sorted(accepted), planned)


def read_sources(
    sources: Sequence[str],
    *,
    model: str | None = None,
    hostfile: str | None = None,
    out: Path | None = None,
    cwd: Path | None = None,
) -> tuple[Report, Context]:
    """Every source read (and the files they name) into one report of claims, not yet resolved; raises UserError
    when a source cannot be read at all."""
    if not sources:
        raise UserError(Problem("name at least one config to import", key="SOURCE"))
    cwd = cwd or Path.cwd()
    report = Report()
    ctx = Context(report, (out.parent if out else cwd), cwd)
    for spec in sources:
        ctx.queue.append((spec, None, None))
    errors: list[Problem] = []
    while ctx.queue:
        spec, kind, label = ctx.queue.pop(0)
        try:
            loaded = load(spec, kind=kind, label=label)
        except UserError as e:
            errors.extend(e.problems)
            continue
        real = os.path.realpath(loaded.path)
        if real in ctx.seen:
            continue  # named twice (on the command line and by another source): read once
        ctx.seen[real] = loaded.label
        ctx.sources.append(f"{loaded.label} ({KIND_NAMES[loaded.kind]})")
        ctx.current_dir = loaded.path.parent
        _read(report.sink(loaded.label, loaded.lines), loaded, ctx)
    if errors:
        raise UserError(errors)
    ctx.current_dir = cwd
    if hostfile is not None:
        ctx.hostfile(report.sink("--hostfile"), hostfile, hostfile)
    _model(report, ctx, model)
    return report, ctx


def _read(sink: Sink, loaded: Loaded, ctx: Context) -> None:
    READERS[loaded.kind](sink, loaded, ctx)


def _model(report: Report, ctx: Context, model: str | None) -> None:
    """model.path from --model (it wins over a source's model) and the hidden size HF's "auto" buckets use."""

    if model is not None:
        for c in report.claims:
            if c.target == "model.path":
                c.status, c.target, c.how = NO_EFFECT, None, f"--model {model} is used instead"
        sink = report.sink("--model")
        sink.map(model, "model.path", ctx.path_value(model, hub=True), "the model to fine-tune")
    chosen = model
    if chosen is None:
        paths = [
            c.value
            for c in report.claims
            if c.target == "model.path" and c.status == "mapped" and isinstance(c.value, str)  # a path_value
        ]
        local = [p for p in paths if (ctx.out_dir / p).is_dir() or Path(p).is_dir()]
        chosen = str(ctx.out_dir / local[0]) if local else None
    cfg, label = None, ""
    if chosen is not None:
        local_dir = Path(os.path.expanduser(chosen))
        if local_dir.is_dir():
            cfg, label = load_model_config(str(local_dir)), os.path.join(chosen, "config.json")
        elif model is not None and looks_like_hub_id(model):
            file = hub_config_file(model)
            cfg, label = load_config_file(file), f"{model}/config.json"
        elif model is not None:
            raise UserError(Problem("not a model directory or a hub id (org/name)", key="--model", file=model))
    if cfg is not None:
        report.hidden_size = hidden_size(cfg, label)
        report.hidden_from = label
    h = report.hidden_size
    rules: dict[str, tuple[str, Callable[[int], int]]] = {
        "zero.reduce_bucket_size": ("hidden_size^2", lambda h: h * h),
        "zero.prefetch_bucket_size": ("int(0.9 x hidden_size^2)", lambda h: int(0.9 * h * h)),
        "zero.param_persistence_threshold": ("10 x hidden_size", lambda h: 10 * h),
    }
    for c in report.claims:
        if c.status == AUTO and c.target in rules:
            rule, f = rules[c.target]
            if h:
                c.how = (
                    f"HF fills {rule} = {f(h)} from {report.hidden_from} (hidden_size {h}); the recipe keeps auto, "
                    "which ftkit derives by the same rule"
                )
            else:
                c.how = (
                    f"HF fills {rule} from the model; the recipe keeps auto, which ftkit derives by the same rule "
                    "from model.path's config.json (no --model given)"
                )


def _stop_if_refused(report: Report, accepted: set[str]) -> None:
    problems = list(report.problems)
    refusable = [c for c in report.claims if c.status == REFUSED]
    for name in sorted(accepted):
        if not any(_accepted(c, {name}) for c in refusable):
            known = ", ".join(sorted({c.key for c in refusable})) or "none"
            problems.append(Problem(f"matches no refused key (refused keys: {known})", key=f"--accept {name}"))
    for c in report.refusals(accepted):
        where = f"{c.source}:{c.line}" if c.line else c.source
        if c.status == HARD:
            problems.append(Problem(c.how, file=where, key=c.key))
        else:
            effect = c.effect
            if effect and not effect.startswith(("accepted", "without", "convert", "set ", "rename")):
                effect = f"accepted: {effect}"
            effect = f"; {effect}" if effect else ""
            hint = f"--accept {c.key.lstrip('-')}"
            problems.append(Problem(f"{c.how}{effect} ({hint} to import without it)", file=where, key=c.key))
    if problems:
        raise UserError(problems)


def _recipe_values(report: Report, ctx: Context) -> tuple[dict[str, Default], list[str]]:
    values: dict[str, Default] = {}
    for f in TOP_LEVEL:
        values[f.name] = f.default
    for s in SECTIONS:
        for f in s.fields:
            values[f"{s.name}.{f.name}"] = list(f.default) if isinstance(f.default, list) else f.default
    values["name"] = "imported"
    peft = any(k.startswith("peft.") for k in report.values) and report.values.get("peft", True) is not None
    for key, value in report.values.items():
        if key == "peft":
            continue
        values[key] = value
    placeholders = []
    for key, placeholder in PLACEHOLDERS.items():
        if key not in report.values:
            values[key] = placeholder
            placeholders.append(key)
    nodes = values["cluster.num_nodes"]
    if isinstance(nodes, int) and nodes > 1 and not values["cluster.hostfile"] and not values["cluster.master_addr"]:
        placeholders.append("cluster.master_addr")  # several nodes, no hostfile: rank 0's address is needed
    if "train.output_dir" not in report.values:
        values["train.output_dir"] = f"./runs/{values['name']}"
    if values.get("train.max_steps") is not None and "train.max_steps" in report.values:
        values["train.epochs"] = None
    elif "train.epochs" in report.values and report.values.get("train.epochs") is not None:
        values["train.max_steps"] = None
    values["peft"] = peft
    return values, placeholders


def _nested(values: Mapping[str, Default]) -> dict[str, object]:
    out: dict[str, object] = {f.name: values[f.name] for f in TOP_LEVEL}
    for s in SECTIONS:
        if s.name == "peft" and not values["peft"]:
            out["peft"] = None
            continue
        out[s.name] = {
            f.name: values[f"{s.name}.{f.name}"] for f in s.fields if values[f"{s.name}.{f.name}"] is not REQUIRED
        }
    return out


def _recipe_text(
    values: Mapping[str, Default],
    sources: list[str],
    report: Report,
    accepted: set[str],
    placeholders: list[str],
) -> str:

    header = [f"# ftkit recipe imported by `ftkit import` (ftkit {__version__}) from:"]
    header += [f"#   {s}" for s in sources]
    header.append("# Every key has its one-line doc above it; the full reference is docs/recipe.md.")
    dropped = [c for c in report.claims if c.status == REFUSED and _accepted(c, accepted)]
    if dropped:
        header.append("# Accepted (--accept) although they change training; not carried:")
        header += [f"#   {c.source} {c.key}: {c.how}" for c in dropped]
    if placeholders:
        header.append(f"# No source names {', '.join(placeholders)}: fill them in below.")
    return commented_recipe(_nested(values), header)


def _validate(text: str, out: Path | None, report: Report) -> None:
    """Load the recipe with ftkit's own loader, so what is written always loads. A value that fails is refused
    where it came from: the source file, line and key that stated it (a placeholder such as an IP address of
    ``1234`` named as one); only a problem no source value explains names the recipe."""

    label = str(out) if out else "the imported recipe"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "recipe.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            load_recipe(path)
        except RecipeError as e:
            problems = []
            for p in e.problems:
                claims = _claims_of(report, p.key) if p.key else []
                if not claims:
                    problems.append(Problem(p.message, file=label, line=p.line, key=p.key))
                for c in claims:
                    where = f"{c.source}:{c.line}" if c.line else c.source
                    problems.append(Problem(_refusal(c, p.key or "", p.message), file=where, key=c.key))
            raise UserError(problems) from None


# recipe keys the readers claim through a pseudo target (resolved by Report.resolve)
_PSEUDO = {
    "train.micro_batch_size": (MICRO,),
    "train.global_batch_size": (GLOBAL, MICRO, ACCUM, WORLD),
    "train.precision": (BF16, FP16),
    "cluster.num_nodes": (NODES,),
    "cluster.gpus_per_node": (WORLD, NODES),
}


def _claims_of(report: Report, key: str) -> list[Claim]:
    """The source keys that stated ``key``'s value (mapped, or "auto" HF fills)."""
    targets = (key, *_PSEUDO.get(key, ()))
    return [c for c in report.claims if c.target in targets and c.status in (MAPPED, DEFAULT, AUTO)]


def _refusal(c: Claim, key: str, message: str) -> str:
    value = fmt(c.value) if c.value is not None else "its value"
    if key == "cluster.master_addr" and isinstance(c.value, str) and placeholder_address(c.value):
        return (
            f"{c.value!r} is a placeholder, not rank 0's address: write the main node's host name or IP address "
            "there (or pass --hostfile)"
        )
    return f"{value} cannot be imported: ftkit's {key} {message}"


def placeholder_address(value: str) -> bool:
    """An address a template leaves for the user to fill in: a bare number (Accelerate's multi_node.yaml has
    ``main_process_ip: '1234'``), a word in angle brackets or capitals, x.x.x.x."""
    text = value.strip()
    return (
        text.isdigit() or re.fullmatch(r"<[^>]*>|\$\{?[A-Za-z_]+\}?|[A-Z_]+|(x+\.){3}x+|X+(\.X+){3}", text) is not None
    )
