"""Renderers: a Plan in, the text of each config file out (deterministic), and an all-or-nothing writer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..plan import Plan
from .accelerate import render_accelerate
from .deepspeed import render_deepspeed, to_json

DS_FILE = "ds_config.json"
ACCELERATE_FILE = "accelerate.yaml"


def render_files(plan: Plan, out_dir: Path, *, ds_path_in_yaml: str | None = None) -> dict[str, str]:
    """The text of every rendered file, keyed by file name; nothing is written."""
    ds_ref = ds_path_in_yaml if ds_path_in_yaml is not None else _ds_reference(plan, out_dir)
    return {
        DS_FILE: to_json(render_deepspeed(plan)),
        ACCELERATE_FILE: render_accelerate(plan, ds_ref),
    }


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
    """Write all files or none: each goes to a temp file first, then all are renamed into place."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[str, Path]] = []
    try:
        for name, text in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            staged.append((name, Path(tmp)))
        written = []
        for name, tmp in staged:
            os.replace(tmp, out_dir / name)
            written.append(out_dir / name)
        return written
    finally:
        for _, tmp in staged:
            if tmp.exists():
                tmp.unlink()
