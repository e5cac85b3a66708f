"""Reading one source file: JSON, YAML or a command line, and telling which format it is.

A source is named ``PATH`` or ``KIND:PATH`` (KIND one of :data:`KINDS`) when its content does not tell. Every
problem (missing file, not UTF-8, bad JSON or YAML, a duplicate key, a file of unknown kind) is one line naming the
file (and line), raised as :class:`ftkit.errors.UserError`: exit 2, no traceback.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias, cast

from ftkit.errors import Problem, RecipeError, UserError
from ftkit.recipe.load import _compose, _to_python, _walk
from ftkit.rundir.records import JSON, JSONObject

KINDS = ("deepspeed", "accelerate", "trainer", "axolotl", "llamafactory")
MAX_BYTES = 1 << 20  # a config is a few KiB

_ACCELERATE = {
    "distributed_type",
    "compute_environment",
    "deepspeed_config",
    "fsdp_config",
    "num_machines",
    "machine_rank",
    "main_training_function",
    "mixed_precision",
    "rdzv_backend",
    "same_network",
    "tpu_env",
    "downcast_bf16",
    "gpu_ids",
    "dynamo_config",
    "megatron_lm_config",
    "fp8_config",
}
_AXOLOTL = {
    "base_model",
    "datasets",
    "micro_batch_size",
    "sequence_len",
    "num_epochs",
    "adapter",
    "lora_r",
    "sample_packing",
    "lora_target_modules",
    "lora_target_linear",
    "val_set_size",
    "dataset_prepared_path",
    "wandb_project",
    "lr_scheduler",
}
_LLAMAFACTORY = {"stage", "finetuning_type", "template", "cutoff_len", "dataset", "lora_target", "lora_rank"}
_DEEPSPEED = {
    "zero_optimization",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
}
_TRAINER = {
    "per_device_train_batch_size",
    "output_dir",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "optim",
    "logging_steps",
    "save_steps",
    "deepspeed",
    "max_grad_norm",
}


Option: TypeAlias = str | bool | list[str]  # a command-line option's value: --key v, --flag (true), --key a b


@dataclass
class Command:
    """A training command line: the launcher's options (world size), the script and its ``--key value`` arguments."""

    launcher: str | None = None  # torchrun | deepspeed | accelerate | python | llamafactory-cli | axolotl
    launcher_opts: dict[str, Option] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    script: str | None = None
    args: dict[str, Option] = field(default_factory=dict)
    positional: list[str] = field(default_factory=list)


@dataclass
class Loaded:
    label: str  # the file as the user (or the file naming it) wrote it
    path: Path
    kind: str
    data: JSONObject | Command  # the parsed mapping, or a Command
    lines: dict[str, int] = field(default_factory=dict)  # dotted key -> line (YAML)

    def mapping(self) -> JSONObject:
        """The parsed mapping of a config file (DeepSpeed and Accelerate sources are never read as a command line)."""
        if isinstance(self.data, Command):
            raise TypeError(f"{self.label}: a {self.kind} command line, not a config file")
        return self.data


def split_spec(spec: str) -> tuple[str | None, str]:
    kind, sep, rest = spec.partition(":")
    if sep and kind.lower().replace("-", "") in KINDS and rest:
        return kind.lower().replace("-", ""), rest
    return None, spec


def read_text(path: Path, label: str) -> str:
    try:
        with open(path, "rb") as fh:
            blob = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise UserError(Problem("not found", file=label)) from None
    except IsADirectoryError:
        raise UserError(Problem("is a directory, expected a config file", file=label)) from None
    except OSError as e:
        raise UserError(Problem(f"cannot read: {e.strerror or e}", file=label)) from None
    if len(blob) > MAX_BYTES:
        raise UserError(Problem("larger than 1 MiB: a config is a few KiB; is this the right file?", file=label))
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(Problem(f"not UTF-8 text ({e.reason})", file=label)) from None


def load(spec: str, kind: str | None = None, label: str | None = None) -> Loaded:
    named_kind, path_text = split_spec(spec)
    kind = kind or named_kind
    label = label or path_text
    path = Path(os.path.expanduser(path_text))
    text = read_text(path, label)
    if kind in (None, "trainer", "llamafactory", "axolotl") and _looks_like_command(path, text):
        cmd = parse_command(text, label)
        return Loaded(label, path, kind or _command_kind(cmd), cmd)
    data, lines = _parse(path, text, label)
    if not isinstance(data, dict):
        if kind in (None, "trainer") and isinstance(data, str) and "--" in data:
            cmd = parse_command(text, label)
            return Loaded(label, path, "trainer", cmd)
        what = "empty" if data is None else f"a {type(data).__name__}, not a mapping of settings"
        raise UserError(Problem(f"{what}: expected a config file of one of the kinds {', '.join(KINDS)}", file=label))
    return Loaded(label, path, kind or detect(data, label), data, lines)


def _looks_like_command(path: Path, text: str) -> bool:
    if path.suffix.lower() in (".json", ".yaml", ".yml"):
        return False
    stripped = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return bool(re.search(r"(^|\s)--[A-Za-z]", stripped)) or path.suffix.lower() in (".sh", ".cmd", ".txt")


def _parse(path: Path, text: str, label: str) -> tuple[JSON, dict[str, int]]:
    if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        return _parse_json(text, label), {}
    return _parse_yaml(text, label)


def _parse_json(text: str, label: str) -> JSON:
    def pairs(items: list[tuple[str, JSON]]) -> JSONObject:
        out: JSONObject = {}
        for k, v in items:
            if k in out:
                raise UserError(Problem("duplicate key; JSON readers keep only the last one: remove one", label, key=k))
            out[k] = v
        return out

    try:
        return cast("JSON", json.loads(text, object_pairs_hook=pairs))
    except json.JSONDecodeError as e:
        raise UserError(Problem(f"invalid JSON: {e.msg}", file=label, line=e.lineno)) from None
    except RecursionError:
        raise UserError(Problem("invalid JSON: nested too deeply", file=label)) from None


def _parse_yaml(text: str, label: str) -> tuple[JSON, dict[str, int]]:

    try:
        node = _compose(text, label)
    except RecipeError as e:
        raise UserError(
            [Problem(p.message.replace("a recipe is flat", "a config is flat"), p.file, p.line) for p in e.problems]
        ) from None
    if node is None:
        return None, {}
    lines: dict[str, int] = {}
    dups: list[tuple[str, int, int]] = []
    _walk(node, "", lines, dups)
    if dups:
        raise UserError(
            [
                Problem(f"duplicate key (also at line {a}); YAML keeps the last one: remove one", label, b, k)
                for k, a, b in dups
            ]
        )
    import yaml

    try:
        return cast("JSON", _to_python(node)), lines  # safe_load's shapes: JSON's
    except yaml.YAMLError as e:
        raise UserError(Problem(f"invalid YAML: {e}", file=label)) from None


def detect(data: JSONObject, label: str) -> str:
    """Which format a parsed mapping is, from the keys only that format uses."""
    keys = {str(k) for k in data}
    if keys & {"distributed_type", "compute_environment"} or isinstance(data.get("deepspeed_config"), dict):
        return "accelerate"
    if "base_model" in keys or len(keys & _AXOLOTL) >= 2:
        return "axolotl"
    if "model_name_or_path" in keys and keys & _LLAMAFACTORY:
        return "llamafactory"
    blocks = any(isinstance(data.get(k), dict) for k in ("fp16", "bf16", "optimizer", "scheduler"))
    if keys & _DEEPSPEED or blocks:
        return "deepspeed"
    if keys & _TRAINER:
        return "trainer"
    if len(keys & _ACCELERATE) >= 2:
        return "accelerate"
    raise UserError(
        Problem(
            "cannot tell which kind of config this is from its keys; name it as KIND:PATH with KIND one of "
            + ", ".join(KINDS),
            file=label,
        )
    )


# ---------------------------------------------------------------------------------------------------------------
# Command lines


LAUNCHERS = ("torchrun", "deepspeed", "accelerate", "llamafactory-cli", "axolotl", "python", "python3")


def parse_command(text: str, label: str) -> Command:
    """The training command in ``text`` (a saved command line or a small shell script): line continuations joined,
    comments and ``export``/``cd`` lines skipped, the last command that has ``--`` options (or names a config)."""
    joined = re.sub(r"\\\r?\n", " ", text)
    candidates: list[list[str]] = []
    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise UserError(Problem(f"cannot split the command line: {e}", file=label)) from None
        if not words or words[0] in ("export", "cd", "set", "source", ".", "echo", "mkdir", "if", "fi", "then"):
            continue
        command = [w for w in words if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w)][:3]
        if any(w.startswith("--") for w in words) or any(os.path.basename(w) in LAUNCHERS for w in command):
            candidates.append(words)
    if not candidates:
        raise UserError(Problem("no command line with --options found", file=label))
    return _command(candidates[-1], label)


def _command(words: list[str], label: str) -> Command:
    cmd = Command()
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[i]):
        name, _, value = words[i].partition("=")
        cmd.env[name] = value
        i += 1
    words = words[i:]
    if not words:
        raise UserError(Problem("the command line has only environment assignments", file=label))
    head = os.path.basename(words[0])
    rest = words[1:]
    if head in ("python", "python3") and rest[:2] in (
        ["-m", "torch.distributed.run"],
        ["-m", "torch.distributed.launch"],
    ):
        head, rest = "torchrun", rest[2:]
    elif head in ("python", "python3") and rest[:2] == ["-m", "deepspeed.launcher.runner"]:
        head, rest = "deepspeed", rest[2:]
    elif head == "accelerate" and rest[:1] == ["launch"]:
        rest = rest[1:]
    elif head in ("llamafactory-cli", "axolotl", "lmf") and rest[:1] == ["train"]:
        cmd.launcher = "llamafactory-cli" if head != "axolotl" else "axolotl"
        cmd.positional = [w for w in rest[1:] if not w.startswith("-") and "=" not in w]
        cmd.args = dict[str, Option](_overrides(rest[1:]))
        return cmd
    cmd.launcher = head if head in LAUNCHERS else None
    if cmd.launcher in (None, "python", "python3"):
        cmd.launcher = "python" if cmd.launcher else None
        if head.endswith(".py"):
            cmd.script, script_at = words[0], -1
        else:
            script_at = _script_index(rest)
    else:
        script_at = _script_index(rest)
    if script_at >= 0 or cmd.script:
        before, after = (rest[:script_at], rest[script_at + 1 :]) if script_at >= 0 else ([], rest)
        if script_at >= 0:
            cmd.script = rest[script_at]
            if cmd.script == "-m" and after:
                cmd.script, after = f"-m {after[0]}", after[1:]
        cmd.launcher_opts = _options(before)
        cmd.args = _options(after, positional=cmd.positional)
    else:
        cmd.args = _options(rest, positional=cmd.positional)
    return cmd


def _script_index(words: list[str]) -> int:
    """Where the training script starts: the first ``something.py`` or ``-m module``."""
    for i, w in enumerate(words):
        if w == "-m" or (w.endswith(".py") and not w.startswith("-")):
            return i
    return -1


def _options(words: list[str], positional: list[str] | None = None) -> dict[str, Option]:
    """``--key value``, ``--key=value``, ``--flag`` (true), ``--key a b`` (a list), names with '-' read as '_'."""
    out: dict[str, Option] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("-") and not _number(w):
            name, eq, value = w.lstrip("-").partition("=")
            name = name.replace("-", "_")
            if eq:
                out[name] = value
                i += 1
                continue
            values = []
            i += 1
            while i < len(words) and not (words[i].startswith("-") and not _number(words[i])):
                values.append(words[i])
                i += 1
            out[name] = True if not values else values[0] if len(values) == 1 else values
        else:
            if positional is not None:
                positional.append(w)
            i += 1
    return out


def _overrides(words: list[str]) -> list[tuple[str, str]]:
    return [(k, v) for k, _, v in (w.partition("=") for w in words if "=" in w and not w.startswith("-"))]


def _number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def _command_kind(cmd: Command) -> str:
    if cmd.launcher == "axolotl" or (cmd.script or "").startswith("-m axolotl"):
        return "axolotl"
    if cmd.launcher == "llamafactory-cli" or set(cmd.args) & _LLAMAFACTORY:
        return "llamafactory"
    return "trainer"
