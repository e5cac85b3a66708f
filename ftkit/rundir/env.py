"""The run's environment contract between ``ftkit launch`` and every rank: which variables of the head's environment
travel to the ranks (the allow-list; secrets are redacted wherever an environment is printed or recorded) and the
``FTKIT_*`` names ftkit sets. Standard library only: both the controller and the ranks import it."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TypedDict

RUN_DIR_ENV = "FTKIT_RUN_DIR"  # the run directory (every rank)
ATTEMPT_ENV = "FTKIT_ATTEMPT"  # the attempt number, counted across launches of the run directory
RESUME_ENV = "FTKIT_RESUME"  # the checkpoint ftkit chose and verified for this attempt; empty: a fresh start
NODE_ENV = "FTKIT_NODE"  # the node's name as the hostfile (and ssh) knows it, for torchrun/accelerate/srun
COMMAND_ENV = "FTKIT_COMMAND"  # the user's command, base64 of JSON, where a shell line cannot carry it (pdsh)
FAULT_ENV = "FTKIT_FAULT_INJECT"  # test-only fault injection (ftkit.launch.rank.Fault)
PACE_ENV = "FTKIT_FAULT_PACE"  # test-only: seconds each rank sleeps after every step (ftkit.launch.rank.Fault)
HOOK_PID_ENV = "FTKIT_HOOK_PID"  # the rank the import hook serves: its child processes leave the hook alone

# Variables forwarded from the head's environment to every rank (glob patterns). Anything else stays behind:
# a stale or secret variable must not leak into a remote job by accident.
ENV_ALLOW = (
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_*",
    "TZ",
    "TMPDIR",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NCCL_*",
    "GLOO_*",
    "TP_SOCKET_IFNAME",
    "UCX_*",
    "HF_*",
    "TRANSFORMERS_*",
    "HUGGING_FACE_*",
    "TORCH_*",
    "TORCHINDUCTOR_*",
    "PYTORCH_*",
    "OMP_NUM_THREADS",
    "MKL_*",
    "DS_*",
    "WANDB_*",
    "MLFLOW_*",
    "FTKIT_*",
)
SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|_KEY$|CREDENTIAL)", re.IGNORECASE)
MASK = "***"
MIN_SECRET_LEN = 6  # shorter values are masked by name only (masking every "1" in a log would hide everything)
# NAME=VALUE as it appears in a shell line, an env file or an argv word: VALUE quoted ('...' or "...") or unquoted
_ASSIGNMENT = re.compile(r"""(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)=('[^']*'?|"(?:[^"\\]|\\.)*"?|[^\s;'"]*)""")


def is_secret(name: str) -> bool:
    """Whether a variable of this name holds a secret (its value is never printed or recorded)."""
    return bool(SECRET.search(name))


def mask_items(items: Iterable[str]) -> list[str]:
    """``cluster.env``'s NAME=VALUE items as they may be recorded: a secret's value masked (spec.json, the
    fingerprint, events)."""
    return [
        f"{item.partition('=')[0]}={MASK}" if "=" in item and is_secret(item.partition("=")[0]) else item
        for item in items
    ]


class Redactor:
    """The one way ftkit masks secrets in whatever it prints or records: environments, argv, shell lines, env
    files, log lines. By name (``NAME=VALUE`` with a secret-looking NAME, whatever the quoting) and by value (every
    place a secret's value appears, raw or in the quoted and escaped forms ftkit and DeepSpeed's runner write it)."""

    def __init__(self, env: Mapping[str, str] | None = None, extra: Iterable[str] = ()):
        values: set[str] = set()
        for k, v in (env or {}).items():
            if is_secret(k) and len(v) >= MIN_SECRET_LEN:
                values.add(v)
        for item in extra:  # NAME=VALUE items (cluster.env)
            name, eq, value = item.partition("=")
            if eq and is_secret(name) and len(value) >= MIN_SECRET_LEN:
                values.add(value)
        forms: set[str] = set()
        for v in values:
            forms.add(v)
            forms.add(shlex.quote(v))  # an ssh line's quoted word
            forms.add(v.replace("'", "'\"'\"'"))  # the same word's inside
            forms.add(re.sub(r'([$`"\\])', r"\\\1", v))  # DeepSpeed's env-file escaping (ds_env_value)
            forms.add(json.dumps(v)[1:-1])  # inside a JSON string
        self.forms = sorted((f for f in forms if len(f) >= MIN_SECRET_LEN), key=len, reverse=True)

    def text(self, text: str) -> str:
        for form in self.forms:
            text = text.replace(form, MASK)
        return _ASSIGNMENT.sub(lambda m: f"{m.group(1)}={MASK}" if is_secret(m.group(1)) else m.group(0), text)

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {k: (MASK if is_secret(k) else self.text(v)) for k, v in env.items()}

    def argv(self, argv: Iterable[str]) -> list[str]:
        return [self.text(a) for a in argv]


DEEPSPEED_ENV_FILE = ".deepspeed_env"  # DeepSpeed's convention: NAME=VALUE lines for the ranks on every host


def read_deepspeed_env(dirs: Iterable[str | os.PathLike[str]]) -> dict[str, str]:
    """The variables of DeepSpeed's ``.deepspeed_env`` files in ``dirs`` (later ones win, as DeepSpeed's runner reads
    the home directory's, then the current directory's): ``NAME=VALUE`` lines; blank lines, ``#`` comments and lines
    without ``=`` are skipped. A file that cannot be read counts as absent."""
    out: dict[str, str] = {}
    for d in dirs:
        try:
            text = (Path(d) / DEEPSPEED_ENV_FILE).read_text()
        except (OSError, UnicodeDecodeError):
            continue
        for line in text.splitlines():
            name, eq, value = line.strip().partition("=")
            if eq and name and not name.startswith("#"):
                out[name.strip()] = value.strip()
    return out


def encode_command(kind: str, target: str, args: list[str], workdir: str) -> str:
    """The user's command for :data:`COMMAND_ENV` (``launch/run_command.py`` decodes it): base64 of JSON, plain
    letters, so no shell on the way can change it."""
    data = json.dumps({"kind": kind, "target": target, "args": list(args), "workdir": workdir})
    return base64.b64encode(data.encode()).decode()


class CommandRecord(TypedDict):
    """The user's command as :func:`encode_command` writes it."""

    kind: str
    target: str
    args: list[str]
    workdir: str


def decode_command(value: str) -> CommandRecord:
    record: CommandRecord = json.loads(base64.b64decode(value.encode(), validate=True))
    return record


def path_with_python_first(python: str, path: str | None) -> str:
    """``PATH`` with the directory of the Python that runs the ranks first, as activating its virtual environment
    does: the tools installed beside it are the ones every rank and ``ftkit.launch.warmup`` run. Above all ninja,
    which torch's just-in-time op builds call by name: the system's ninja 1.11 and pip's 1.13 (a DeepSpeed
    dependency) hash build commands differently, so each one rebuilds what the other built (a minute or more of
    compiling in a rank's start-up, measured on CPU ranks) whenever processes find different ones."""
    first = os.path.dirname(python)
    rest = [p for p in (path or os.defpath).split(os.pathsep) if p and p != first]
    return os.pathsep.join([first, *rest])


def ftkit_cache() -> Path:
    """This user's ftkit cache, ``${XDG_CACHE_HOME:-~/.cache}/ftkit``: what ftkit measured or built once and keeps
    across runs on this host (bandwidth, traced profiles, a rank's transformers import table)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")) / "ftkit"
