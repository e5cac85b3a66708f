"""The run's environment contract between ``ftkit launch`` and every rank: which variables of the head's environment
travel to the ranks (the allow-list; secrets are redacted wherever an environment is printed or recorded) and the
``FTKIT_*`` names ftkit sets. Standard library only: both the controller and the ranks import it."""

from __future__ import annotations

import base64
import json
import os
import re
from typing import TypedDict

RUN_DIR_ENV = "FTKIT_RUN_DIR"  # the run directory (every rank)
ATTEMPT_ENV = "FTKIT_ATTEMPT"  # the attempt number, counted across launches of the run directory
RESUME_ENV = "FTKIT_RESUME"  # the checkpoint ftkit chose and verified for this attempt; empty: a fresh start
NODE_ENV = "FTKIT_NODE"  # the node's name as the hostfile (and ssh) knows it, for torchrun/accelerate/srun
COMMAND_ENV = "FTKIT_COMMAND"  # the user's command, base64 of JSON, where a shell line cannot carry it (pdsh)
FAULT_ENV = "FTKIT_FAULT_INJECT"  # test-only fault injection (ftkit.launch.rank.Fault)
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
