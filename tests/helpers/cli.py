"""The real ``ftkit`` command line, in a process of its own, as a user runs it.

The quick tier runs the command line a few hundred times. A fresh interpreter pays Python's start-up and ftkit's
imports each time (~0.4 CPU-seconds, most of the tier's time); a fork of the test process runs the same ``main()``
with the modules already loaded. The child is still a process of its own: its own exit status, standard streams,
working directory and environment, Python's default signal handlers, warnings and exit handlers, nothing of the
test's. A fresh interpreter is used where a fork could differ from what a user runs:

* ``env`` changes the environment and the test process already holds a library that reads the environment once,
  when it is imported (``huggingface_hub``'s offline flag and cache paths: :data:`ENV_READ_AT_IMPORT`);
* the test process has torch loaded: its thread pools do not survive a fork;
* ``fresh=True``, or ``FTKIT_TEST_FRESH_CLI=1`` for the whole suite.

What a command imports at start-up, and how ``python -m ftkit`` itself behaves, is tested with fresh interpreters
(``tests/cli/test_cli.py``: ``test_config_commands_import_no_heavy_stack``).
"""

from __future__ import annotations

import atexit
import importlib
import io
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

FTKIT_MAIN = str(Path(__file__).resolve().parents[2] / "ftkit" / "__main__.py")  # sys.argv[0] of `python -m ftkit`
# libraries that read environment variables when they are imported (a fork would see the test process's values)
ENV_READ_AT_IMPORT = ("huggingface_hub", "transformers", "torch", "datasets", "mlflow", "wandb")
# Python's own warning filters when no -W option or PYTHONWARNINGS is given (the test process has pytest's)
DEFAULT_WARNING_FILTERS = [
    ("default", None, DeprecationWarning, "__main__", 0),
    ("ignore", None, DeprecationWarning, None, 0),
    ("ignore", None, PendingDeprecationWarning, None, 0),
    ("ignore", None, ImportWarning, None, 0),
    ("ignore", None, ResourceWarning, None, 0),
]


def run_ftkit(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 60, fresh: bool | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real `ftkit` command line in a process of its own (as a user would); see the module's docstring."""
    if fresh is None:
        fresh = (
            "torch" in sys.modules
            or (bool(env) and any(m in sys.modules for m in ENV_READ_AT_IMPORT))
            or os.environ.get("FTKIT_TEST_FRESH_CLI") == "1"
        )
    e = dict(os.environ)
    e.update(env or {})
    if fresh:
        return subprocess.run(
            [sys.executable, "-m", "ftkit", *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout
        )
    _load_in_this_process(args[0] if args else "")
    return _forked(list(args), cwd, e, timeout)


def _load_in_this_process(command: str) -> None:
    """Imports the command line and ``command``'s module here, once, so that every fork finds them loaded."""
    from ftkit.cli.main import COMMANDS

    if command in COMMANDS:
        importlib.import_module(f"ftkit.cli.{COMMANDS[command]}")


def _forked(args: list[str], cwd: Path | None, env: dict, timeout: float) -> subprocess.CompletedProcess[str]:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test process
        code = 1
        try:
            os.close(out_r)
            os.close(err_r)
            code = _child_main(args, cwd, env, out_w, err_w)
        except BaseException:  # noqa: BLE001 - whatever happens, the child reports it and ends here
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    out, err = _read_both(out_r, err_r, pid, timeout, args)
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(
        [sys.executable, "-m", "ftkit", *args], os.waitstatus_to_exitcode(status), out, err
    )


def _child_main(args: list[str], cwd: Path | None, env: dict, out_w: int, err_w: int) -> int:
    """``python -m ftkit ARGS`` from ``main()`` on, in the forked child; returns the exit status."""
    signal.setitimer(signal.ITIMER_REAL, 0)  # the test's timeout alarm (pytest-timeout) is the parent's
    for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for fd in (null, out_w, err_w):
        os.close(fd)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = _writer(1, "strict", write_through=unbuffered)
    sys.stderr = _writer(2, "backslashreplace", write_through=True)
    atexit._clear()  # the test process's exit handlers are not the command's
    logging.root.handlers.clear()  # pytest's capture handlers; a fresh process has none
    logging.root.setLevel(logging.WARNING)
    warnings.filters[:] = DEFAULT_WARNING_FILTERS
    warnings._showwarnmsg_impl = _print_warning  # type: ignore[attr-defined]  # pytest records them instead
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [FTKIT_MAIN, *args]
    from ftkit.cli.main import main

    try:
        main()
        code = 0
    except SystemExit as e:  # as the interpreter ends a process on SystemExit
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: its traceback and status 1, as Python does
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
    return code


def _writer(fd: int, errors: str, *, write_through: bool) -> io.TextIOWrapper:
    raw = io.BufferedWriter(io.FileIO(fd, "w", closefd=False))
    return io.TextIOWrapper(raw, encoding="utf-8", errors=errors, write_through=write_through)


def _print_warning(msg: warnings.WarningMessage) -> None:
    sys.stderr.write(warnings._formatwarnmsg(msg))  # type: ignore[attr-defined]


def _read_both(out_r: int, err_r: int, pid: int, timeout: float, args: list[str]) -> tuple[str, str]:
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                for fd in list(sel.get_map()):
                    sel.unregister(fd)
                    os.close(fd)
                raise subprocess.TimeoutExpired([sys.executable, "-m", "ftkit", *args], timeout)
            for key, _ in sel.select(left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
                    os.close(key.fd)
    out, err = (b"".join(chunks[fd]).decode("utf-8", "replace") for fd in (out_r, err_r))
    return _newlines(out), _newlines(err)


def _newlines(text: str) -> str:
    """As ``subprocess.run(text=True)`` reads it (universal newlines)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")
