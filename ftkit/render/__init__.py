"""Renderers: a Plan in, the text of each config file out (deterministic), and an all-or-nothing writer."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from ftkit.errors import os_error
from ftkit.plan.plan import Plan
from ftkit.render.accelerate import render_accelerate
from ftkit.render.deepspeed import render_deepspeed, to_json
from ftkit.rundir.layout import creation_mode

DS_FILE = "ds_config.json"
ACCELERATE_FILE = "accelerate.yaml"


def render_files(plan: Plan, out_dir: Path, *, ds_path_in_yaml: str | None = None) -> dict[str, str]:
    """The text of every rendered file, keyed by file name; nothing is written. FSDP2 has no ds_config.json."""
    if plan.recipe.train.backend == "fsdp2":
        return {ACCELERATE_FILE: render_accelerate(plan, None)}
    ds_ref = ds_path_in_yaml if ds_path_in_yaml is not None else _ds_reference(plan, out_dir)
    return {
        DS_FILE: to_json(render_deepspeed(plan)),
        ACCELERATE_FILE: render_accelerate(plan, ds_ref),
    }


def unused_files(plan: Plan, out_dir: Path) -> list[str]:
    """Rendered files in ``out_dir`` the plan's backend does not use (a ds_config.json left from DeepSpeed)."""
    return [n for n in (DS_FILE, ACCELERATE_FILE) if n not in render_files(plan, out_dir) and (out_dir / n).is_file()]


def _ds_reference(plan: Plan, out_dir: Path) -> str:
    """How accelerate.yaml names ds_config.json: relative to the recipe's directory (where `accelerate launch` is
    expected to run in a repository that checks in its configs), so the file is the same on every machine."""
    target = (out_dir / DS_FILE).resolve()
    base = plan.recipe.base_dir.resolve()
    try:
        return os.path.relpath(target, base) if target.is_relative_to(base) else str(target)
    except ValueError:  # pragma: no cover - different drives
        return str(target)


def write_files(out_dir: Path, files: dict[str, str]) -> list[Path]:
    """Write all files or none: each goes to a temp file first, then all are renamed into place.

    Files get the mode a plain ``open()`` would give them (0666 less the umask), not mkstemp's 0600. An OSError
    (no space, read-only, not a directory, ...) becomes an FtkitError naming the path, with no temp file left.
    """

    if out_dir.exists() and not out_dir.is_dir():
        raise os_error(NotADirectoryError(errno.ENOTDIR, "not a directory", str(out_dir)), out_dir, "cannot write")
    staged: list[tuple[str, Path]] = []
    target: Path | None = None  # the file being written; None while making the directory
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        mode = creation_mode()
        for name, text in files.items():
            target = out_dir / name
            fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
            staged.append((name, Path(tmp_name)))
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                os.fchmod(fh.fileno(), mode)
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        written = []
        for name, tmp in staged:
            target = out_dir / name
            os.replace(tmp, target)
            written.append(target)
        return written
    except OSError as e:
        # Name the file being written, not its temp name; while making directories, the one that failed.
        where = target if target is not None else (e.filename or out_dir)
        raise os_error(_with_path(e, where), where, "cannot write") from None
    finally:
        for _, tmp in staged:
            if tmp.exists():
                tmp.unlink()


def _with_path(e: OSError, path: object) -> OSError:
    return OSError(e.errno, e.strerror, str(path))
