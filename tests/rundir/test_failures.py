"""Issue 35: the failure classes both sides name (ftkit.rundir.failures), from real exceptions and real logs."""

from __future__ import annotations

import traceback

import pytest

from ftkit.rundir.failures import classify, classify_exit, exception_line, log_frames, signature
from tests.helpers.paths import REPO

GPU_LOGS = REPO / "tests" / "fixtures" / "gpu"


@pytest.mark.parametrize("log", ["z2-arch-9.0a-rank0.log", "no-nvcc-launch.log"])
def test_the_gpu_run_s_crash_loops_are_not_restartable(log):
    """Both failures of the first GPU run (an arch suffix DeepSpeed 0.19 cannot parse; no CUDA toolkit): op builds a
    restart cannot change, read from the rank's log alone (no record: the built-in entry leaves none)."""
    lines = (GPU_LOGS / log).read_text().splitlines()
    line = exception_line(lines)
    assert line is not None and ("invalid literal for int()" in line or "CUDA_HOME" in line), line
    cls = classify_exit(1, line, log_frames(lines))
    assert cls.name == "op_build" and not cls.restartable


def _of(exc: BaseException) -> tuple[list[str], str, list[str]]:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
        return [c.__name__ for c in type(e).__mro__], f"{type(e).__name__}: {e}", frames


@pytest.mark.parametrize(
    "exc,name,restartable",
    [
        (ModuleNotFoundError("No module named 'flash_attn'"), "import_error", False),
        (SyntaxError("invalid syntax"), "syntax_error", False),
        (FileNotFoundError(2, "No such file or directory", "/data/train.jsonl"), "missing_file", False),
        (
            OSError("CUDA_HOME environment variable is not set. Please set it to your CUDA install root."),
            "op_build",
            False,
        ),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom_at_start", False),
        (RuntimeError("[gloo] Connection reset by peer"), "comm_error", True),
        (RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)"), "comm_error", True),
        (RuntimeError("CUDA error: uncorrectable ECC error encountered"), "gpu_error", True),
        (ValueError("something in the script"), "exception", True),
    ],
)
def test_exceptions_are_classed_by_type_message_and_origin(exc, name, restartable):
    names, message, frames = _of(exc)
    cls = classify(names, message, frames)
    assert (cls.name, cls.restartable) == (name, restartable)


@pytest.mark.heavy
def test_a_library_s_configuration_error_is_classed_by_where_it_was_raised():
    """DeepSpeed's pydantic config refuses a key (a ValidationError from its own config code)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    names, message, frames = _of_call(lambda: DeepSpeedZeroConfig(stage=2, no_such_knob=1))
    assert classify(names, message, frames).name == "config_error"


def _of_call(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return [c.__name__ for c in type(e).__mro__], f"{type(e).__name__}: {e}", [
            f.filename for f in traceback.extract_tb(e.__traceback__)
        ]  # fmt: skip
    raise AssertionError("no exception")


def test_exit_statuses_and_signatures():
    assert classify_exit(-9, None).name == "killed" and classify_exit(247, None).name == "killed"  # DeepSpeed's -9
    assert classify_exit(137, None).name == "killed" and classify_exit(1, None).name == "exit"
    assert classify_exit(1, "RuntimeError: [rank1] Connection closed by peer").name == "comm_error"
    # torchrun's [rankN]: prefixes; the last exception line wins
    assert exception_line(["[rank0]: Traceback (most recent call last):", "[rank0]: KeyError: 'x'", "done"]) == (
        "KeyError: 'x'"
    )
    # a port, a pid or a time in the message must not make a repeat look new
    assert signature("RuntimeError: refused (pid 1234) at 10.0.0.1:8000") == signature(
        "RuntimeError: refused (pid 99) at 10.0.0.1:8000"
    )


def test_a_missing_checkpoint_file_is_ftkit_s_own_and_restarted():
    """A resume whose local checkpoint vanished (rotated away, a cleanup) must not be taken for the user's missing
    file: a restart chooses the checkpoint again (seen in make gpu-check's rehearsal)."""
    line = (
        "FileNotFoundError: [Errno 2] No such file or directory: "
        "'/dev/shm/ftkit-demo-5ac01894/localhost/checkpoint-8/trainer_state.json'"
    )
    assert classify_exit(1, line).name == "exception"
    assert classify_exit(1, "FileNotFoundError: [Errno 2] No such file or directory: '/runs/x/events.jsonl'",
                         own=["/runs/x"]).name == "exception"  # fmt: skip
    assert classify_exit(1, "FileNotFoundError: [Errno 2] No such file or directory: '/data/train.jsonl'",
                         own=["/runs/x"]).name == "missing_file"  # fmt: skip
