"""Prepare a run directory: render the configs the run will use and write the spec every rank reads."""

from __future__ import annotations

import json

from ftkit.plan.plan import Plan
from ftkit.render import render_files, write_files
from ftkit.run.make_spec import build_spec
from ftkit.rundir.layout import RunDir, atomic_write
from ftkit.rundir.records import JSON, Fingerprint


def prepare_run(
    plan: Plan,
    *,
    load_universal: bool = False,
    resume_overrides: dict[str, JSON] | None = None,
    fingerprint: Fingerprint | None = None,
    command: list[str] | None = None,
) -> RunDir:
    """Write ``ftkit/ds_config.json``, ``ftkit/accelerate.yaml``, ``ftkit/spec.json`` and ``ftkit/recipe.json`` (the
    resolved recipe, for the commands that read the run afterwards; no rank reads it) into the run directory.

    The run's copy of the configs uses absolute paths (it is not meant to be checked in), and is rewritten at
    every launch so a changed recipe (e.g. more steps) takes effect when resuming. ``load_universal`` adds
    DeepSpeed's ``checkpoint.load_universal`` for the one attempt that resumes a converted checkpoint on a
    different world size (see :mod:`ftkit.supervise.universal`). ``resume_overrides``: changed recipe values the user
    allowed (``--allow-changes``) that a resumed attempt applies after loading its checkpoint; kept across the
    attempts of one launch (a later shrink rewrites the spec with them too). ``fingerprint``: already computed by
    the caller (it hashes the data file), else computed here.
    """
    rd = RunDir(plan.recipe.train.output_dir)
    files = render_files(plan, rd.meta, ds_path_in_yaml=str(rd.ds_config.resolve()))
    if load_universal:
        cfg = json.loads(files["ds_config.json"])
        cfg["checkpoint"] = {"load_universal": True}
        files["ds_config.json"] = json.dumps(cfg, indent=2) + "\n"
    write_files(rd.meta, files)
    if "ds_config.json" not in files:  # FSDP2: a ds_config.json an earlier DeepSpeed launch wrote is not this run's
        rd.ds_config.unlink(missing_ok=True)
    if resume_overrides is None and rd.spec.is_file():
        try:
            resume_overrides = json.loads(rd.spec.read_text()).get("resume_overrides")
        except (OSError, ValueError, AttributeError):
            resume_overrides = None
    spec = build_spec(
        plan,
        rd.path.resolve(),
        rd.ds_config.resolve(),
        fingerprint=fingerprint,
        resume_overrides=resume_overrides,
        command=command,
    )
    atomic_write(rd.recipe, json.dumps(plan.recipe.to_dict(), indent=2, default=str) + "\n")
    atomic_write(rd.spec, spec.to_json())
    return rd
