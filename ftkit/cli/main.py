"""The ``ftkit`` command group and its single exit point for errors.

Library code raises :class:`ftkit.errors.FtkitError`; here, and only here, it becomes a message on stderr (one
line per problem, no traceback) and the documented exit code. Two safety nets sit beside it: an ``OSError`` that
no command turned into an FtkitError (a full disk, a read-only or unreadable place) becomes one line naming the
path (exit 12 for no space, else 2), and Ctrl-C becomes one line and exit 130 (click would say "Aborted!", exit 1).
"""

from __future__ import annotations

import errno
import importlib
import os
import sys

import click

from ftkit import __version__
from ftkit.errors import ExitCode, FtkitError, Problem, UserError, os_error

# Each command's module in ftkit.cli, imported when the command runs (or when --help lists them all): ``ftkit
# render`` does not pay for importing the launch, doctor and export commands' libraries.
COMMANDS = {
    "init": "init",
    "import": "import_",
    "render": "render",
    "check": "check",
    "explain": "explain",
    "plan": "plan",
    "doctor": "doctor",
    "launch": "launch",
    "submit": "submit",
    "status": "status",
    "report": "report",
    "stop": "stop",
    "schema": "schema",
    "export": "export",
}

EPILOG = """\b
Examples:
  ftkit init myjob --template lora      # write myjob/recipe.yaml and myjob/hostfile
  ftkit import ds_config.json -o myjob/recipe.yaml   # or start from the configs you have
  ftkit plan myjob/recipe.yaml          # which ZeRO stage fits, and why
  ftkit render myjob/recipe.yaml        # write myjob/configs/{ds_config.json,accelerate.yaml}
  ftkit check myjob/recipe.yaml         # fail (exit 1) when checked-in configs drifted
  ftkit launch myjob/recipe.yaml        # run it, restarting from the newest committed checkpoint
"""


class FtkitGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:  # noqa: ARG002
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:  # noqa: ARG002
        module = COMMANDS.get(cmd_name)
        if module is None:
            return None
        command: click.Command = importlib.import_module(f"ftkit.cli.{module}").command
        return command

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except FtkitError as e:
            _fail(e)
        except OSError as e:
            if e.filename is None and _stdout_broken(e):
                if e.errno == errno.EPIPE:
                    sys.exit(ExitCode.OK)  # `ftkit schema | head`: the reader had enough
                _fail(os_error(e, "standard output", "writing"))
            _fail(from_os_error(e))
        except RuntimeError as e:
            if not str(e).startswith("Symlink loop from "):
                raise
            # Path.resolve() on Python < 3.13 reports a symlink loop as RuntimeError, not OSError(ELOOP)
            path = str(e).removeprefix("Symlink loop from ").strip("'\"")
            _fail(from_os_error(OSError(errno.ELOOP, "symlink loop", path)))
        except KeyboardInterrupt:
            click.echo("ftkit: interrupted (Ctrl-C)", err=True)
            sys.exit(ExitCode.SIGINT)


_WHAT = {
    errno.EROFS: "read-only file system; write somewhere else",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of this path is a file, not a directory",
    errno.EISDIR: "is a directory, expected a file",
    errno.ELOOP: "too many levels of symbolic links (a symlink loop?)",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "already exists",
    errno.ENAMETOOLONG: "file name too long",
}


def from_os_error(e: OSError) -> FtkitError:
    """The safety net's one line for an OSError no command handled: the path(s) it names and what went wrong."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return os_error(e, where or "a device ftkit writes to", "writing")
    what = _WHAT.get(e.errno or -1) or e.strerror or type(e).__name__
    return UserError(Problem(what, file=where or None))


def _fail(e: FtkitError) -> None:
    for line in e.lines():
        click.echo(f"ftkit: error: {line}", err=True)
    sys.exit(e.exit_code)


def _stdout_broken(e: OSError) -> bool:
    """Whether ``e`` came from click.echo writing to standard output (a full /dev/full, a closed pipe). If so, point
    standard output at /dev/null, so the interpreter's own flush at exit does not print a second error (exit 120)."""
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "echo" and frame.f_globals.get("__name__") == "click.utils":
            try:
                to_stdout = frame.f_locals["file"].fileno() == sys.stdout.fileno()
            except (KeyError, AttributeError, OSError, ValueError):
                to_stdout = False
            if to_stdout:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
                return True
        tb = tb.tb_next
    return False


@click.group(cls=FtkitGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ftkit")
def cli() -> None:
    """ftkit: one fine-tuning recipe in; DeepSpeed and Accelerate configs, a memory plan, a launched and
    supervised HF Trainer job out."""


def main() -> None:
    cli(prog_name="ftkit")
