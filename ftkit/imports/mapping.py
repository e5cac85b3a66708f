"""The mapping report, and how the claims of several sources become one set of recipe values.

Each source reader (one module per format) walks its file and says, for every key it finds, one of: *mapped* to a
recipe key (the value as the source states it), *auto* (a DeepSpeed ``"auto"`` that HF Trainer fills from the
TrainingArguments or the model), *default* / *no effect* (nothing to carry: it equals what ftkit does, or it only
changes logging, launching or speed), *refused* (it changes training and ftkit cannot carry it: the import stops
with exit 2 unless the key is named in ``--accept``) or *hard* (cannot be imported at all: fp8, TPU/XPU, preference
objectives, tensor parallelism).

Values go to *targets*: recipe keys, or the pseudo keys below, resolved once every source has been read
(:meth:`Report.resolve`), the way HF Trainer resolves them: a DeepSpeed value that TrainingArguments also sets must
equal it (HF refuses a mismatch), ``"auto"`` takes the TrainingArguments value (or its default when no source gives
one), and the batch triple is derived from micro batch x accumulation x world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import cast

from ftkit.errors import Problem
from ftkit.recipe.schema import Value

MAPPED, DEFAULT, AUTO, NO_EFFECT, REFUSED, HARD = "mapped", "default", "auto", "no effect", "refused", "hard"
FOLLOWED = "followed"  # a key naming another file, read as a source of its own

# Pseudo targets: resolved into recipe keys by Report.resolve.
MICRO, ACCUM, GLOBAL = "batch.micro", "batch.accum", "batch.global"
WORLD, NODES = "world.size", "world.nodes"
BF16, FP16 = "precision.bf16", "precision.fp16"
DS_OPTIMIZER, TA_OPTIM = "optimizer.deepspeed", "optimizer.trainer"  # DeepSpeed's block wins over TA's `optim`
# TrainingArguments' optim values that are AdamW (what ftkit configures, DeepSpeed's own, with the same values)
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw", "adamw_apex_fused", "adamw_torch_xla")

# Targets HF Trainer fills into DeepSpeed's "auto" (and checks a concrete DeepSpeed value against): the
# TrainingArguments name and its default (transformers 5).
HF_FILLED: dict[str, tuple[str, Value]] = {
    MICRO: ("per_device_train_batch_size", 8),
    ACCUM: ("gradient_accumulation_steps", 1),
    "train.max_grad_norm": ("max_grad_norm", 1.0),
    "train.learning_rate": ("learning_rate", 5e-5),
    "train.adam_beta1": ("adam_beta1", 0.9),
    "train.adam_beta2": ("adam_beta2", 0.999),
    "train.adam_epsilon": ("adam_epsilon", 1e-8),
    "train.weight_decay": ("weight_decay", 0.0),
    BF16: ("bf16", False),
    FP16: ("fp16", False),
    "train.warmup_steps": ("warmup_steps", 0),
}
# What an HF Trainer run does for training-math settings no source states: TrainingArguments' defaults.
HF_UNSTATED: dict[str, tuple[str, Value]] = {
    **HF_FILLED,
    "train.lr_scheduler": ("lr_scheduler_type", "linear"),
    "train.epochs": ("num_train_epochs", 3.0),
}

_SHOWN = {MICRO: "train.micro_batch_size", ACCUM: "gradient accumulation", GLOBAL: "train.global_batch_size"}
_SHOWN |= {WORLD: "world size", NODES: "cluster.num_nodes", BF16: "train.precision", FP16: "train.precision"}


@dataclass
class Claim:
    """What one source says about one of its keys."""

    source: str  # the file as named on the command line (or as another source names it)
    key: str  # the key as the source spells it (dotted for nested blocks)
    status: str
    target: str | None = None
    value: Value = None
    how: str = ""  # how it was mapped, or why it is not carried
    effect: str = ""  # what dropping it changes in training (refused, no effect)
    origin: str = "ds"  # "ds": a DeepSpeed-config value; "ta": a TrainingArguments value (HF fills "auto" from it)
    checked: bool = True  # a DeepSpeed value HF checks against TrainingArguments (False: implied by an absent key)
    line: int | None = None
    shown: str = ""  # the text after the status, set by Report.resolve

    def text(self) -> str:
        where = f"{self.source}:{self.line}" if self.line else self.source
        sep = " " if self.shown.startswith("->") else ": "
        return f"{where} {self.key}: {self.status_label()}{(sep + self.shown) if self.shown else ''}"

    def status_label(self) -> str:
        return {
            MAPPED: "mapped",
            DEFAULT: "equal to ftkit's default",
            AUTO: '"auto"',
            NO_EFFECT: "not carried",
            REFUSED: "not supported",
            HARD: "refused",
            FOLLOWED: "read",
        }[self.status]


@dataclass
class Report:
    """Every claim of every source, then the resolved recipe values and the problems that stop the import."""

    claims: list[Claim] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    values: dict[str, Value] = field(default_factory=dict)  # resolved recipe values (dotted keys)
    notes: list[str] = field(default_factory=list)  # lines about values no source states
    trainer_sources: list[str] = field(default_factory=list)  # sources whose values are TrainingArguments
    hidden_size: int | None = None
    hidden_from: str = ""

    # -- reading ---------------------------------------------------------------------------------------------

    def sink(self, source: str, lines: dict[str, int] | None = None) -> Sink:
        return Sink(self, source, lines or {})

    def problem(self, source: str, key: str | None, message: str, line: int | None = None) -> None:
        self.problems.append(Problem(message, file=source, line=line, key=key))

    # -- resolving -------------------------------------------------------------------------------------------

    def on(self, target: str, statuses: Iterable[str] = (MAPPED, DEFAULT)) -> list[Claim]:
        wanted = set(statuses)
        return [c for c in self.claims if c.target == target and c.status in wanted]

    def resolve(self, world_default: tuple[int, int]) -> None:
        """Decide every target's value, HF's way; fill ``values`` and each claim's shown text."""
        self._precedence()
        for target in sorted({c.target for c in self.claims if c.target}):
            if target in HF_FILLED:
                self._resolve_filled(target)
            elif target not in (GLOBAL, WORLD, NODES, DS_OPTIMIZER, TA_OPTIM):
                self._resolve_plain(target)
        self._resolve_precision()
        if "train.precision" not in self.values and self.claims:
            self.values["train.precision"] = "fp32"
            self.notes.append(
                "train.precision = fp32: no source enables bf16 or fp16, so an HF Trainer run trains in fp32 "
                "(TrainingArguments' defaults bf16=false, fp16=false)"
            )
        self._resolve_batch(world_default)
        for target, (name, default) in HF_UNSTATED.items():
            if target in (MICRO, ACCUM, BF16, FP16) or target in self.values:
                continue
            if target == "train.epochs" and "train.max_steps" in self.values:
                continue
            self.values[target] = default
            if target == "train.epochs":
                self.values["train.max_steps"] = None
            self.notes.append(
                f"{target} = {_fmt(default)}: no source states it; an HF Trainer run uses TrainingArguments' "
                f"default ({name}={_fmt(default)})"
            )
        for c in self.claims:
            if not c.shown:
                c.shown = self._shown(c)

    def _precedence(self) -> None:
        """HF uses a DeepSpeed config's optimizer and scheduler blocks instead of TrainingArguments' optim and
        lr_scheduler_type; without an optimizer block, TA's optim must be an AdamW to be carried."""
        ds_sched = any(c.key.endswith("scheduler.type") and c.origin == "ds" for c in self.claims)
        ds_opt = self.on(DS_OPTIMIZER)
        for c in self.claims:
            if c.origin != "ta" or c.status not in (MAPPED, DEFAULT):
                continue
            said = f"{c.how}; " if c.how else ""  # e.g. "Axolotl's default": kept in front
            if c.target == "train.lr_scheduler" and ds_sched:
                c.status, c.target = NO_EFFECT, None
                c.how = said + "the DeepSpeed config's scheduler block is used instead (HF ignores lr_scheduler_type)"
            elif c.target == TA_OPTIM and ds_opt:
                c.status, c.target = NO_EFFECT, None
                c.how = said + "the DeepSpeed config's optimizer block is used instead (HF ignores optim then)"
            elif c.target == TA_OPTIM and str(c.value).lower() in ADAMW_OPTIMS:
                c.status, c.target = DEFAULT, None
                c.how = said + "AdamW: what ftkit configures, with the same hyperparameters (same update)"
            elif c.target == TA_OPTIM:
                c.status, c.target = REFUSED, None
                c.how = said + f"optimizer {c.value}: ftkit trains with AdamW only"
                c.effect = "accepted, the run uses AdamW"
        for c in ds_opt:
            c.target, c.how = None, "DeepSpeed's AdamW, what ftkit configures" + (f" ({c.how})" if c.how else "")

    def _agreed(self, target: str, claims: list[Claim]) -> Value:
        """The value the claims agree on; a problem naming each source when they do not."""
        values = {_key(c.value) for c in claims}
        if len(values) > 1:
            said = ", ".join(f"{c.source} {c.key} = {_fmt(c.value)}" for c in claims)
            self.problem(claims[-1].source, claims[-1].key, f"sources disagree on {_SHOWN.get(target, target)}: {said}")
        return claims[0].value

    def _resolve_plain(self, target: str) -> None:
        claims = self.on(target)
        if claims:
            self.values[target] = self._agreed(target, claims)
        elif fallback := self.on(target, (REFUSED,)):  # used only when the refusal is accepted
            self.values[target] = fallback[0].value
        for c in self.on(target, (AUTO,)):
            if target not in self.values:
                self.values[target] = c.value
            c.shown = f"-> {target} = {_fmt(self.values[target])} ({c.how})" if c.how else ""

    def _resolve_filled(self, target: str) -> None:
        """DeepSpeed value vs TrainingArguments value, HF's way (fill_match): "auto" takes the TrainingArguments
        value, a concrete DeepSpeed value must equal it, a value implied by an absent DeepSpeed key wins."""
        name, default = HF_FILLED[target]
        ds = [c for c in self.on(target) if c.origin == "ds"]
        ta = [c for c in self.on(target) if c.origin == "ta"]
        autos = self.on(target, (AUTO,))
        ta_value: Value = None
        ta_from = ""
        if ta:
            ta_value = self._agreed(target, ta)
            ta_from = f"{ta[0].source} {ta[0].key}"
        elif self.trainer_sources or autos:
            ta_value = default
            ta_from = f"TrainingArguments' default {name}={_fmt(default)}" + (
                "" if self.trainer_sources else ", no trainer arguments among the sources"
            )
        checked = [c for c in ds if c.checked]
        implied = [c for c in ds if not c.checked]
        if checked:
            ds_value = self._agreed(target, checked)
            if (ta or self.trainer_sources) and ta_value is not None and not _equal(ds_value, ta_value):
                c = checked[0]
                self.problem(
                    c.source,
                    c.key,
                    f"{_fmt(ds_value)} but TrainingArguments {name} is {_fmt(ta_value)} ({ta_from}): HF Trainer "
                    'refuses the mismatch; make them equal or write "auto"',
                    c.line,
                )
            value = ds_value
        elif implied:
            value = implied[0].value
            for c in ta:
                c.shown = f"-> no effect: {implied[0].source} {implied[0].how}"
                c.status = NO_EFFECT
        elif ta_value is not None:
            value = ta_value
        else:
            return
        if target in (BF16, FP16):
            self.values[target] = bool(value)
        else:
            self.values[target] = value
        for c in autos:
            c.value = value
            shown = _SHOWN.get(target, target)
            c.shown = f"-> {shown} = {_fmt(value)} (HF fills it from {ta_from})"

    def _resolve_precision(self) -> None:
        bf16, fp16 = self.values.pop(BF16, None), self.values.pop(FP16, None)
        if bf16 is None and fp16 is None:
            return
        if bf16 and fp16:
            c = (self.on(BF16) or self.on(FP16) or self.on(BF16, (AUTO,)))[0]
            self.problem(c.source, c.key, "bf16 and fp16 are both enabled: DeepSpeed and HF refuse that; pick one")
            return
        precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
        self.values["train.precision"] = precision
        for c in self.claims:
            if c.target in (BF16, FP16) and c.status == AUTO:
                flag = "bf16" if c.target == BF16 else "fp16"
                c.shown = c.shown.replace(f"-> train.precision = {_fmt(c.value)}", f"-> {flag} {_fmt(c.value)}")
                c.shown += f"; train.precision = {precision}"

    def _resolve_batch(self, world_default: tuple[int, int]) -> None:
        # readers claim the batch triple, the world size and the node count as whole numbers only (to_int)
        micro, accum = _whole(self.values.pop(MICRO, None)), _whole(self.values.pop(ACCUM, None))
        glob = self.on(GLOBAL)
        glob_value = _whole(self._agreed(GLOBAL, glob)) if glob else None
        world_claims = self.on(WORLD)
        world = _whole(self._agreed(WORLD, world_claims)) if world_claims else None
        nodes_claims = self.on(NODES)
        nodes = _whole(self._agreed(NODES, nodes_claims)) if nodes_claims else None
        if micro is None:
            micro = cast(int, HF_FILLED[MICRO][1])
            self.notes.append(
                f"train.micro_batch_size = {micro}: no source states it; an HF Trainer run uses TrainingArguments' "
                f"default (per_device_train_batch_size={micro})"
            )
        world_from = "; ".join(f"{c.source} {c.key}" for c in world_claims)
        # tensor/sequence parallelism: only the data-parallel ranks multiply the micro batch
        group = int(cast(int, self.values.get("parallel.tp") or 1)) * int(
            cast(int, self.values.get("parallel.sp") or 1)
        )
        if world is None and glob_value is not None and accum is not None and glob_value % (micro * accum) == 0:
            world = glob_value // (micro * accum) * group
            world_from = f"train_batch_size {glob_value} / (micro {micro} x accumulation {accum})" + (
                f" x tp x sp {group}" if group > 1 else ""
            )
            self.notes.append(f"(derived) world size {world}: {world_from}")
        if world is None:
            n, per = world_default
            world = n * per
            nodes = nodes or n
            self.notes.append(
                f"world size {world}: no source states it; ftkit's default cluster ({n} node x {per} processes): "
                "set cluster.num_nodes/gpus_per_node or pass --hostfile"
            )
        dp = world // group if world % group == 0 else world  # the plan refuses a layout that does not divide
        if accum is None and glob_value is not None and glob_value % (micro * dp) == 0:
            accum = glob_value // (micro * dp)  # DeepSpeed derives the missing one of the triple
        if accum is None:
            accum = cast(int, HF_FILLED[ACCUM][1])
            self.notes.append(f"gradient accumulation {accum}: no source states it; TrainingArguments' default")
        computed = micro * accum * dp
        if glob_value is not None and glob_value != computed:
            c = glob[0]
            self.problem(
                c.source,
                c.key,
                f"{glob_value} is not micro batch {micro} x accumulation {accum} x "
                + (f"world size {world}" if group == 1 else f"data-parallel degree {dp} (world {world} / {group})")
                + f" = {computed}: DeepSpeed refuses this; fix one of the four",
                c.line,
            )
        self.values["train.micro_batch_size"] = micro
        self.values["train.global_batch_size"] = computed
        nodes = nodes or 1
        if world % nodes:
            c = (nodes_claims or world_claims or glob)[0]
            self.problem(c.source, c.key, f"world size {world} does not divide over {nodes} nodes")
            nodes = 1
        self.values.setdefault("cluster.num_nodes", nodes)
        self.values.setdefault("cluster.gpus_per_node", world // nodes)
        triple = f"{micro} x {accum} x {dp} = {computed}"
        ranks = "world size" if group == 1 else "data-parallel degree"
        for c in self.on(GLOBAL, (MAPPED, DEFAULT, AUTO)):
            how = "HF computes it" if c.status == AUTO else "equal to"
            c.shown = f"-> train.global_batch_size = {computed} ({how} micro x accumulation x {ranks}: {triple})"
        for c in self.on(ACCUM, (MAPPED, DEFAULT, AUTO)):
            if c.status != AUTO:
                how = f"{c.how}; " if c.how else ""
                c.shown = f"-> gradient accumulation {_fmt(c.value)} ({how}train.global_batch_size = {triple})"
            else:
                c.shown += f"; train.global_batch_size = {triple}"
        for c in world_claims:
            c.shown = f"-> world size {world} ({world_from}): cluster {nodes} node(s) x {world // nodes} processes"

    def _shown(self, c: Claim) -> str:
        if c.status in (MAPPED, DEFAULT):
            if c.target is None:
                return c.how
            shown = _SHOWN.get(c.target, c.target)
            value = c.value
            if c.target in (BF16, FP16):
                flag = "bf16" if c.target == BF16 else "fp16"
                how = f"; {c.how}" if c.how else ""
                return f"-> {flag} {_fmt(c.value)} (train.precision = {self.values.get('train.precision', '?')}{how})"
            return f"-> {shown} = {_fmt(value)}" + (f" ({c.how})" if c.how else "")
        if c.status == AUTO:
            return f"-> {c.how}"
        text = c.how
        if c.effect:
            text = f"{text}; {c.effect}" if text else c.effect
        return text

    # -- reporting -------------------------------------------------------------------------------------------

    def refusals(self, accepted: AbstractSet[str]) -> list[Claim]:
        """Claims that stop the import: hard ones always, refused ones unless accepted."""
        return [c for c in self.claims if c.status == HARD or (c.status == REFUSED and not _accepted(c, accepted))]

    def lines(self, accepted: AbstractSet[str] = frozenset()) -> list[str]:
        """One line per source key (claims on several targets from one key, e.g. betas, share it)."""
        out: list[str] = []
        last: Claim | None = None
        for c in self.claims:
            if last is not None and (c.source, c.key, c.status) == (last.source, last.key, last.status):
                more = c.shown.removeprefix("-> ")
                if more and more not in out[-1]:
                    out[-1] += f"; {more}"
                continue
            line = c.text()
            if c.status == REFUSED and _accepted(c, accepted):
                line = line.replace(": not supported", ": accepted (--accept), not carried", 1)
            out.append(line)
            last = c
        return out + [n if n.startswith("(derived)") else f"(not in any source) {n}" for n in self.notes]


def leaves(key: str, value: object) -> list[str]:
    """The dotted keys of a block's leaves (a list is a leaf), or ``[key]`` for a value or an empty block."""
    if not isinstance(value, dict) or not value:
        return [key]
    return [leaf for k, v in value.items() for leaf in leaves(f"{key}.{k}", v)]


def _accepted(c: Claim, accepted: AbstractSet[str]) -> bool:
    """Whether ``--accept`` names this key: as the report spells it (leading dashes optional), or a block above it."""
    key = c.key.lstrip("-")
    return any(key == a.lstrip("-") or key.startswith(a.lstrip("-") + ".") for a in accepted)


def _whole(value: Value) -> int | None:
    """A batch, world or node value: an int (or None when no source states it), as the readers claim them."""
    return cast("int | None", value)


def _key(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return tuple(_key(v) for v in value)
    return value


def _equal(a: object, b: object) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return _key(a) == _key(b)


def _fmt(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, float):
        return repr(int(value)) if value.is_integer() and 1e6 <= abs(value) < 1e16 else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


fmt = _fmt


class Sink:
    """What a source reader writes to: one claim per key of one source file."""

    def __init__(self, report: Report, source: str, lines: dict[str, int]):
        self.report = report
        self.source = source
        self.lines = lines

    def _add(
        self,
        key: str,
        status: str,
        *,
        target: str | None = None,
        value: Value = None,
        how: str = "",
        effect: str = "",
        origin: str = "ds",
        checked: bool = True,
    ) -> Claim:
        c = Claim(
            self.source,
            key,
            status,
            target=target,
            value=value,
            how=how,
            effect=effect,
            origin=origin,
            checked=checked,
            line=self.lines.get(key),
        )
        self.report.claims.append(c)
        return c

    def map(self, key: str, target: str, value: Value, how: str = "", *, origin: str = "ds") -> Claim:
        """The source states ``value`` for ``target``."""
        return self._add(key, MAPPED, target=target, value=value, how=how, origin=origin)

    def tool_default(self, key: str, target: str, value: Value, how: str, *, absent: bool = True) -> Claim:
        """A key the source leaves out (or unset), which the tool that reads it (Axolotl, LLaMA-Factory) fills with
        its own default before it builds TrainingArguments: a TrainingArguments value, as if the source stated it."""
        return self._add(f"{key} (absent)" if absent else key, MAPPED, target=target, value=value, how=how,
                         origin="ta")  # fmt: skip

    def implied(self, key: str, target: str, value: Value, how: str) -> Claim:
        """A key the source leaves out, whose absence decides a value (e.g. no gradient_clipping: no clipping)."""
        return self._add(f"{key} (absent)", MAPPED, target=target, value=value, how=how, checked=False)

    def auto(self, key: str, target: str, how: str = "", value: Value = None) -> Claim:
        """A DeepSpeed "auto": HF fills it (from TrainingArguments when ``target`` is one HF fills)."""
        return self._add(key, AUTO, target=target, how=how, value=value)

    def auto_filled(self, key: str, how: str) -> Claim:
        """A DeepSpeed "auto" HF fills at run time from something no recipe key holds (the run's step count)."""
        return self._add(key, AUTO, how=how)

    def same(self, key: str, how: str) -> Claim:
        """Nothing to carry: the value is what ftkit does anyway (or unset)."""
        return self._add(key, DEFAULT, how=how)

    def followed(self, key: str, how: str) -> Claim:
        """A key naming another file, which is read as a source too (its keys are listed under its own name)."""
        return self._add(key, FOLLOWED, how=how)

    def no_effect(self, key: str, why: str, effect: str = "") -> Claim:
        """Not carried, and training does not change (logging, launching, speed, rounding)."""
        return self._add(key, NO_EFFECT, how=why, effect=effect)

    def no_effect_each(self, key: str, value: object, why: str, effect: str = "") -> None:
        """Not carried, for every key of a block (each named in the report), or for ``key`` when it is no block."""
        for leaf in leaves(key, value):
            self.no_effect(leaf, why, effect)

    def same_each(self, key: str, value: object, how: str) -> None:
        """Nothing to carry, for every key of a block (each named in the report)."""
        for leaf in leaves(key, value):
            self.same(leaf, how)

    def refuse(self, key: str, why: str, effect: str = "") -> Claim:
        """Not carried, and training changes: the import stops unless the key is accepted."""
        return self._add(key, REFUSED, how=why, effect=effect)

    def hard(self, key: str, why: str) -> Claim:
        """Cannot be imported at all (ftkit cannot run it: fp8, TPU/XPU, preference objectives)."""
        return self._add(key, HARD, how=why)

    def unknown(self, key: str, value: object, kind: str) -> Claim:
        return self.refuse(
            key,
            f"unknown {kind} key (= {_fmt(value)})",
            "ftkit cannot tell what it changes in training; check the spelling, or --accept it to import without it",
        )

    def problem(self, key: str | None, message: str) -> None:
        self.report.problem(self.source, key, message, self.lines.get(key or ""))
