"""Run the user's command inside a rank when it cannot travel on a shell line (DeepSpeed's pdsh runner).

DeepSpeed's pdsh runner joins ``cd CWD; python -u -m deepspeed.launcher.launch ... SCRIPT ARGS`` into one remote
shell line and quotes only arguments with spaces, so ``$(...)``, ``&``, quotes and the launch directory's name
would reach the remote shell as shell syntax. ftkit therefore starts this module on every rank instead
(``--module ftkit.launch.run_command``, no arguments, from the validated run directory) and carries the command in
``FTKIT_COMMAND``: base64 of JSON ``{"kind", "target", "args", "workdir"}``
(:func:`ftkit.command.engines.encode_command` writes it), plain letters on any shell line. Here it is decoded and run in
this very process (the rank's pid is the one the engine started): a module with ``runpy.run_module``, a script with
``runpy.run_path``, an executable with ``os.execv``, in the working directory the user launched from. Standard library
only.
"""

from __future__ import annotations

import os
import runpy
import sys

from ftkit.rundir.env import COMMAND_ENV, decode_command


def main() -> None:
    raw = os.environ.pop(COMMAND_ENV, "")
    if not raw:
        raise SystemExit(f"python -m ftkit.launch.run_command: {COMMAND_ENV} is not set (it is set by ftkit launch)")
    cmd = decode_command(raw)
    kind, target, args, workdir = cmd["kind"], cmd["target"], [str(a) for a in cmd["args"]], cmd["workdir"]
    os.chdir(workdir)
    if kind == "exec":
        os.execv(target, [target, *args])
    if kind == "module":
        sys.argv = [target, *args]
        sys.path[0] = workdir  # what `python -m` puts first: the working directory
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "script":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # what `python SCRIPT` puts first
        runpy.run_path(target, run_name="__main__")
    else:
        raise SystemExit(f"python -m ftkit.launch.run_command: unknown command kind {kind!r}")


if __name__ == "__main__":
    main()
