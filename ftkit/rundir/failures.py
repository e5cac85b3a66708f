"""Why an attempt failed, as a class both sides name the same way: whether a restart can change it.

A restart helps when the cause is outside the program: a rank killed (SIGKILL, the OOM killer), a peer lost, a
collective that timed out, a GPU fault (Xid, ECC), a hang. It cannot help when the program meets the same wall
again: a module that is not installed, a file that is not there, a configuration a library refuses, an op that cannot
be built, CUDA out of memory before anything trained. (NVIDIA Resiliency Extension's restart agent draws the same
line between restartable faults and ``RestartAbort``.) The first kind is restarted within
``resilience.max_restarts``; the second stops the launch at once with exit 14 and the rank's own exception line,
and so does any start-up failure that repeats the previous attempt's cause word for word.

:func:`classify` names the class of an exception from its type, its message and where it was raised (rank side,
:mod:`ftkit.launch.failures`); :func:`classify_exit` of a process that left no record, from its exit status and the
last exception line of its log (:func:`exception_line`). Standard library only: the ranks and the supervisor both
read it. Every failure event in ``events.jsonl`` carries its class (``failure_class``).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from ftkit.rundir.layout import NEARLY_FULL


@dataclass(frozen=True)
class FailureClass:
    name: str
    restartable: bool
    hint: str = ""


IMPORT = FailureClass("import_error", False, "install it for the ranks' Python on every host")
SYNTAX = FailureClass("syntax_error", False, "fix the script")
MISSING_FILE = FailureClass("missing_file", False, "the path must exist, readable, on every host")
OP_BUILD = FailureClass(
    "op_build", False, "ftkit doctor checks the toolchain on every host; zero.cpu_adam false needs no build"
)
CONFIG = FailureClass("config_error", False, "a library refused its configuration: fix the recipe or the script")
OOM_AT_START = FailureClass(
    "oom_at_start", False, "out of device memory before the first step: ftkit plan; lower the micro batch or offload"
)
SCRIPT_EXIT = FailureClass("script_exit", False, "the script exited with an error status before its first step")
NO_SPACE = FailureClass("no_space", False, "free space; committed checkpoints are intact")
EXCEPTION = FailureClass("exception", True)  # anything else: restarted, unless it repeats before the first step
COMM = FailureClass("comm_error", True)  # a collective or the rendezvous failed: a peer died or the network failed
GPU = FailureClass("gpu_error", True)  # Xid, ECC, a lost device: hardware, restarted (on other devices if shrunk)
KILLED = FailureClass("killed", True)  # ended by a signal (SIGKILL: ftkit's teardown, the OOM killer, a user)
EXIT = FailureClass("exit", True)  # a non-zero exit status and nothing else known
HANG = FailureClass("hang", True)
HOST_LOST = FailureClass("host_lost", True)

BY_NAME = {
    c.name: c
    for c in (
        IMPORT,
        SYNTAX,
        MISSING_FILE,
        OP_BUILD,
        CONFIG,
        OOM_AT_START,
        SCRIPT_EXIT,
        NO_SPACE,
        EXCEPTION,
        COMM,
        GPU,
        KILLED,
        EXIT,
        HANG,
        HOST_LOST,
    )
}

# Messages that name the class whatever the exception's type (DeepSpeed and torch raise plain RuntimeError,
# OSError and ValueError for these), checked in this order
_MESSAGES: tuple[tuple[FailureClass, re.Pattern[str]], ...] = (
    (
        COMM,
        re.compile(
            r"by peer|Connection (closed|reset|refused)|Broken pipe|Socket Timeout|NCCL (communicator|error|WARN "
            r"Timeout)|ProcessGroup\w* .*(timed out|Timeout)|Watchdog caught collective operation timeout|"
            r"DistNetworkError|DistBackendError|Gloo connectFullMesh failed|rendezvous .*(timed out|closed)",
            re.I,
        ),
    ),
    (
        GPU,
        re.compile(
            r"\bXid\b|uncorrectable ECC|ECC error|CUDA error: (unspecified launch failure|unknown error)|"
            r"device-side assert|CUDA-capable device.*(is|are) busy or unavailable|GPU is lost",
            re.I,
        ),
    ),  # fmt: skip
    (
        OP_BUILD,
        re.compile(
            r"CUDA_HOME environment variable is not set|Error building extension|Unable to JIT load|"
            r"ninja (is required|not found)|nvcc|compute_capability|TORCH_CUDA_ARCH_LIST|"
            r"The detected CUDA version .* mismatches|No CUDA runtime is found",
            re.I,
        ),
    ),
    (OOM_AT_START, re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.I)),
)
# Where a library checks its configuration: an error raised from there is the configuration's
_CONFIG_FRAMES = re.compile(
    r"deepspeed/runtime/(config|zero/config|config_utils)\.py|deepspeed/runtime/engine\.py.*_configure|"
    r"transformers/training_args\.py|transformers/integrations/deepspeed\.py|accelerate/utils/dataclasses\.py|"
    r"accelerate/state\.py|peft/(config|tuners/.*/config)\.py"
)
_CONFIG_TYPES = ("ValidationError", "DeepSpeedConfigError", "ConfigError", "ZeRORuntimeException")
# A checkpoint's own file (ftkit chose the checkpoint; one that vanished is chosen again, not the user's mistake)
_OWN_FILE = re.compile(r"/checkpoint-\d+(/|'|$)|/\.?ftkit[-/]|ftkit_commit\.json")
# Where an op is built: any error raised on the way (the GPU log's ``int('0a')`` in compute_capability_args)
_OP_BUILD_FRAMES = re.compile(r"deepspeed/ops/op_builder/|torch/utils/cpp_extension\.py")
_TRANSIENT_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGBUS, signal.SIGSEGV)


# DeepSpeed's CPU collectives (its shm comm op) map one workspace per rank into /dev/shm:
# 2 x 1 MiB (small messages) + 2 x 32 MiB (large ones), deepspeed/ops/csrc/cpu/comm/shm.cpp. A tmpfs too small
# for them does not fail the mapping: the ranks die by SIGBUS/SIGSEGV when they first write past its end.
DS_SHM_BYTES_PER_RANK = 2 * (1 << 20) + 2 * 32 * (1 << 20)
# How a write that filled its file system shows: OSError ENOSPC/EDQUOT, torch.save's "unexpected pos" (the zip writer
# checks its own position) and "file write failed", safetensors' StorageFull
NO_SPACE_TEXT = ("No space left", "StorageFull", "write failed", "unexpected pos", "Disk quota exceeded")


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes where ``path`` is (or would be: its nearest existing parent); very many when it cannot be told."""
    p = str(path)
    while p and not os.path.exists(p) and p != "/":
        p = os.path.dirname(p.rstrip("/")) or "/"
    try:
        return shutil.disk_usage(p or "/").free
    except OSError:
        return 1 << 62


def full_path(message: str, errno_: int | None, paths: Iterable[str | os.PathLike[str]]) -> str | None:
    """The path among ``paths`` a failed write filled (the run directory, a local checkpoint tier), or None when the
    error is not a full file system. ENOSPC names one whatever its free space now (the failed save may already have
    removed its partial file)."""
    candidates = [str(p) for p in paths]
    enospc = errno_ in (errno.ENOSPC, errno.EDQUOT)
    if not enospc and not any(t in message for t in NO_SPACE_TEXT):
        return None
    nearly = [p for p in candidates if free_bytes(p) < NEARLY_FULL]
    if nearly:
        return nearly[0]
    return candidates[0] if enospc and candidates else None


def classify(
    type_names: Iterable[str],
    message: str,
    frames: Iterable[str] = (),
    before_first_step: bool = True,
    own: Iterable[str] = (),
) -> FailureClass:
    """The class of an exception: ``type_names`` its class and base class names (``OSError``,
    ``FileNotFoundError``...), ``message`` its text, ``frames`` the files of its traceback (innermost last).
    ``own``: where ftkit's own files are (the run directory, the local tier): a file missing there is not the
    user's (a checkpoint gone from under a resume): restarted, and ftkit chooses again."""
    names = set(type_names)
    frames = list(frames)
    if _MESSAGES[0][1].search(message):
        return COMM
    if any(_OP_BUILD_FRAMES.search(f) for f in frames):
        return OP_BUILD
    for cls, pattern in _MESSAGES:
        if pattern.search(message):
            if cls is OOM_AT_START and not before_first_step:
                return EXCEPTION  # out of memory at step N: a restart with the same batch meets it again at N
            return cls
    if names & {"ModuleNotFoundError", "ImportError"}:
        return IMPORT
    if names & {"SyntaxError", "IndentationError", "TabError"}:
        return SYNTAX
    if names & {"FileNotFoundError", "IsADirectoryError", "NotADirectoryError", "PermissionError"}:
        if _OWN_FILE.search(message) or any(p and p in message for p in own):
            return EXCEPTION
        return MISSING_FILE
    if names & set(_CONFIG_TYPES) or any(_CONFIG_FRAMES.search(f) for f in frames[-3:]):
        return CONFIG
    return EXCEPTION


def classify_exit(
    code: int | None, log_line: str | None, frames: Iterable[str] = (), own: Iterable[str] = ()
) -> FailureClass:
    """The class of a process that ended with ``code`` (negative: killed by that signal; 128+N as a shell reports
    it; DeepSpeed's launcher reports a SIGKILLed rank as 247 = -9 & 0xff) and left no record; ``log_line``: the last
    exception line of its log (:func:`exception_line`), when there is one."""
    if code is not None:
        sig = -code if code < 0 else code - 128 if 128 < code < 160 else 9 if code == 247 else None
        if sig in {int(s) for s in _TRANSIENT_SIGNALS}:
            return KILLED
    if log_line:
        name, _, message = log_line.partition(":")
        return classify([name.rsplit(".", 1)[-1]], message, frames, own=own)
    return EXIT


_EXCEPTION_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?)$"
)


def exception_line(lines: Iterable[str]) -> str | None:
    """The last ``SomeError: message`` line of a log (a Python traceback's last line; ``[rankN]:`` prefixes as
    torchrun writes them are dropped), or None."""
    found = None
    for line in lines:
        m = _EXCEPTION_LINE.match(line.strip())
        if m:
            found = m.group(1).strip()
    return found


_FRAME = re.compile(r'^\s*(?:\[rank\d+\]:\s*)?File "([^"]+)", line \d+')


def log_frames(lines: Iterable[str]) -> list[str]:
    """The files of a log's last traceback, outermost first."""
    frames: list[str] = []
    for line in lines:
        if "Traceback (most recent call last)" in line:
            frames = []
        m = _FRAME.match(line)
        if m:
            frames.append(m.group(1))
    return frames


def signature(line: str) -> str:
    """What makes two start-up failures "the same cause": the exception line with numbers, addresses and paths
    of temporary files blurred (a port, a pid, a time in the message must not make a repeat look new)."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x", line)
    return re.sub(r"\d+", "N", text)[:300]
