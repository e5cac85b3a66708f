"""The user's own training command (``ftkit launch RECIPE -- CMD``, or ``train.command``) as every rank runs it:
``python SCRIPT ARGS``, ``python -m MODULE ARGS`` or an executable, checked before anything starts (a script or module
that is not there, a launcher inside the ranks), and the directory of ftkit's import hook for it."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from importlib.machinery import ModuleSpec
    from types import SimpleNamespace

# Launchers under a launcher would start launchers inside ranks: ftkit starts the engine itself.
_LAUNCHER_PROGRAMS = {"accelerate", "torchrun", "deepspeed", "srun", "mpirun"}


_LAUNCHER_MODULES = {
    "torch.distributed.run",
    "torch.distributed.launch",
    "accelerate.commands.launch",
    "accelerate.commands.accelerate_cli",
    "deepspeed.launcher.runner",
    "deepspeed.launcher.launch",
}


_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


# `trl sft ...` is TRL's accelerate-launch wrapper around trl/scripts/sft.py: ftkit runs the script itself.
TRL_NOT_TRAINING = {"env", "vllm-serve", "vllm_serve", "utils", "__init__"}


@dataclass(frozen=True)
class UserCommand:
    """The user's training command, as every rank runs it: ``kind`` is ``script`` (``python SCRIPT ARGS``, the
    script's absolute path), ``module`` (``python -m MODULE ARGS``) or ``exec`` (an executable such as a console
    script, its absolute path). ``note`` says what ftkit made of the command line when it is not verbatim."""

    kind: str
    target: str
    args: tuple[str, ...] = ()
    note: str | None = None

    def display(self, python: str = "python") -> list[str]:
        if self.kind == "script":
            return [python, self.target, *self.args]
        if self.kind == "module":
            return [python, "-m", self.target, *self.args]
        return [self.target, *self.args]


def parse_command(
    argv: Sequence[str],
    cwd: str,
    which: Callable[[str], str | None],
    trl_dir: str | None = None,
    find_module: Callable[[str], bool] | None = None,
) -> UserCommand:
    """``CMD [ARGS]`` after ``--`` (or ``train.command``) as a :class:`UserCommand`; raises UserError naming the
    problem. ``which`` resolves an executable (``shutil.which``); ``trl_dir`` is TRL's package directory, if
    installed (``trl sft ...`` is unwrapped to ``python -m trl.scripts.sft ...``); ``find_module`` says whether the
    ranks' interpreter can find a module (:func:`module_exists`; None: not checked). Reads nothing else."""
    argv = [str(a) for a in argv]
    if not argv or not argv[0]:
        raise UserError("command: empty: give the program after `--` (e.g. -- python train.py --output_dir out)")
    prog, rest = argv[0], argv[1:]
    name = Path(prog).name
    if _PYTHON.fullmatch(name):
        command = _python_command(prog, rest, cwd)
        if command.kind == "module" and find_module is not None and not find_module(command.target):
            raise UserError(
                f"command: {prog} -m {command.target}: no module named {command.target!r} (looked in {cwd} and "
                "the ranks' Python path; check the name, or install the package)"
            )
        return command
    if name in _LAUNCHER_PROGRAMS:
        raise UserError(_launcher_problem(name))
    if name == "trl" and rest and trl_dir and not rest[0].startswith("-") and rest[0] not in TRL_NOT_TRAINING:
        sub = rest[0]
        if _MODULE.fullmatch(sub) and (Path(trl_dir) / "scripts" / f"{sub}.py").is_file():
            return UserCommand(
                "module",
                f"trl.scripts.{sub}",
                tuple(rest[1:]),
                note=f"`trl {sub}` is an accelerate-launch wrapper: ftkit runs its script on every rank itself, "
                f"as `python -m trl.scripts.{sub}` (accelerate options in ARGS are not used)",
            )
    path = prog if "/" in prog else which(prog)
    if path is None:
        raise UserError(f"command: {prog}: not found on PATH (give a path, or `python script.py`)")
    full = Path(cwd, path)
    if not full.is_file():
        raise UserError(f"command: {prog}: no such file")
    return UserCommand("exec", str(full.resolve()), tuple(rest))


def _python_command(prog: str, rest: list[str], cwd: str) -> UserCommand:
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "-":
        opt = rest[i]
        if opt == "-u":  # ranks are unbuffered anyway (PYTHONUNBUFFERED=1)
            i += 1
            continue
        if opt == "-m" or (opt.startswith("-m") and len(opt) > 2):
            mod = rest[i + 1] if opt == "-m" and i + 1 < len(rest) else opt[2:]
            args = rest[i + 2 :] if opt == "-m" else rest[i + 1 :]
            if not mod or not _MODULE.fullmatch(mod):
                raise UserError(f"command: {prog} -m: {mod!r} is not a module name")
            if mod in _LAUNCHER_MODULES:
                raise UserError(_launcher_problem(f"python -m {mod}"))
            return UserCommand("module", mod, tuple(args))
        raise UserError(
            f"command: {prog} {opt}: only `python SCRIPT ARGS`, `python -m MODULE ARGS` (and -u) can be started "
            "on every rank; put the code in a script"
        )
    if i >= len(rest):
        raise UserError(f"command: {prog}: no script or -m MODULE given")
    script = Path(cwd, rest[i])
    if not script.is_file():
        raise UserError(f"command: {rest[i]}: script not found (relative to {cwd})")
    return UserCommand("script", str(script.resolve()), tuple(rest[i + 1 :]))


def module_exists(name: str, search: Sequence[str]) -> bool:
    """Whether ``python -m NAME`` finds the module, with ``search`` first on the path (the working directory, then
    ``PYTHONPATH``), without importing it or its parents: the top-level name through the import system's own
    finders (editable installs included), the rest as files under the packages found."""
    import importlib.util
    import sys

    top, *rest = name.split(".")
    saved = list(sys.path)
    sys.path[:0] = [p for p in search if p not in sys.path]
    spec: ModuleSpec | SimpleNamespace | None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = saved
    fullname = top
    for part in rest:
        locations = spec.submodule_search_locations if spec is not None else None
        if locations is None:
            return False
        fullname = f"{fullname}.{part}"
        spec = _find_submodule(fullname, list(locations))
    return spec is not None


def _find_submodule(fullname: str, locations: list[str]) -> ModuleSpec | SimpleNamespace | None:
    """Ask the import system's finders for ``fullname`` inside a package's locations; imports nothing (an editable
    install maps subpackages that are not under the package's directory, e.g. ``ftkit.launch``)."""
    import importlib.machinery
    import sys

    for finder in [*sys.meta_path, importlib.machinery.PathFinder]:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, locations)
        except Exception:  # noqa: BLE001 - a finder that cannot answer (some expect the parent imported): next
            continue
        if spec is not None:
            return spec
    # A namespace package (a directory without __init__.py): the finders need its parent imported to say so.
    from types import SimpleNamespace

    part = fullname.rsplit(".", 1)[-1]
    for loc in locations:
        if (Path(loc) / part).is_dir():
            return SimpleNamespace(submodule_search_locations=[str(Path(loc) / part)])
        if any((Path(loc) / f"{part}{suffix}").is_file() for suffix in importlib.machinery.all_suffixes()):
            return SimpleNamespace(submodule_search_locations=None)
    return None


def _launcher_problem(what: str) -> str:
    return (
        f"command: {what} is a launcher: ftkit starts the engine itself and a launcher under it would start "
        "launchers inside the ranks; give the training script (-- python train.py ARGS) and choose the engine "
        "with cluster.engine or --engine"
    )


def builtin_only_keys(explicit: set[str] | frozenset[str]) -> list[str]:
    """The ``data.*`` and ``peft.*`` keys a recipe sets: they describe the built-in entry, not a user command."""
    return sorted(k for k in explicit if k.split(".")[0] in ("data", "peft"))


def inject_dir() -> str:
    """The directory holding ftkit's ``sitecustomize.py`` (``launch/inject``, shipped as ``ftkit/launch/inject``).

    Found without importing ``ftkit.launch``."""
    import importlib.util

    spec = importlib.util.find_spec("ftkit.launch")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - a broken install
        raise UserError("ftkit.launch is not installed: reinstall ftkit")
    return str(Path(list(spec.submodule_search_locations)[0]) / "inject")
