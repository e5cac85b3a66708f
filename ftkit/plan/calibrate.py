"""Step-time calibration from measured runs: what a run directory measured, and the calibration kept beside it.

Every run writes ``metrics.jsonl`` (rank 0: one line per logged step, with its wall time) and ``ftkit/spec.json`` (the
resolved recipe and hosts it ran with). :func:`measured_step` reads a run's seconds per optimizer step (the median
interval between logged steps of one attempt, without an attempt's first interval and those holding a save);
:func:`run_recipe` gives back the recipe it ran, so the planner can predict that very configuration
(:func:`ftkit.plan.plan.calibration_points`) and :func:`ftkit.plan.speed.fit` scale the model to the measurement.

A calibration is kept beside the run it is for: ``RUN/ftkit/calibration.json`` in the recipe's run directory, which
the next plan of that recipe reads (:func:`stored_calibration`; only for the same GPU class).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ftkit.plan.speed import Calibration, CalPoint
from ftkit.recipe.load import Recipe
from ftkit.recipe.schema import SECTIONS, TOP_LEVEL, Value
from ftkit.rundir.layout import RunDir, atomic_write, read_metrics
from ftkit.rundir.records import JSONObject, as_int, as_number

CALIBRATION_FILE = "calibration.json"
MIN_INTERVALS = 3  # fewer measured step intervals than this calibrate nothing


def calibration_path(run_dir: str | Path) -> Path:
    return RunDir(run_dir).meta / CALIBRATION_FILE


def stored_calibration(run_dir: str | Path, gpu: str) -> Calibration | None:
    """The calibration kept beside ``run_dir`` for this GPU class, or None (none, another class, unreadable)."""
    try:
        data = json.loads(calibration_path(run_dir).read_text())
        cal = Calibration.from_json(data) if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
    return cal if cal is not None and cal.gpu_class == gpu and cal.points else None


def store(run_dir: str | Path, cal: Calibration) -> Path:
    """Keep ``cal`` beside ``run_dir`` (created if needed); the path written."""
    path = calibration_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(cal.as_json(), indent=2) + "\n", fsync=False)
    return path


def measured_step(run_dir: str | Path) -> tuple[float, int] | None:
    """(median seconds per optimizer step, intervals it is the median of) from ``metrics.jsonl``; None when fewer
    than :data:`MIN_INTERVALS` clean intervals were logged."""
    try:
        rows = read_metrics(RunDir(run_dir).metrics)
    except OSError:
        return None
    saved = {(as_int(m.get("attempt")), as_int(m.get("step"))) for m in rows if m.get("event") == "commit"}
    logged = [
        (as_int(m.get("attempt")) or 0, as_int(m.get("step")) or 0, as_number(m.get("time")))
        for m in rows
        if "loss" in m and m.get("event") is None
    ]
    gaps: list[float] = []
    first: set[int] = set()
    for (a1, s1, t1), (a2, s2, t2) in zip(logged, logged[1:], strict=False):
        if a1 != a2 or s2 <= s1 or t1 is None or t2 is None or t2 <= t1:
            continue
        if a1 not in first:  # an attempt's first interval holds its warm-up
            first.add(a1)
            continue
        if any((a1, s) in saved for s in range(s1, s2)):
            continue  # a save happened in this interval
        gaps.append((t2 - t1) / (s2 - s1))
    if len(gaps) < MIN_INTERVALS:
        return None
    return statistics.median(gaps), len(gaps)


def run_recipe(run_dir: str | Path) -> tuple[Recipe, list[tuple[str, int]]] | None:
    """The resolved recipe and hosts a run ran with (its ``ftkit/recipe.json`` and ``ftkit/spec.json``; a run
    directory from before the recipe left the spec has it in the spec), or None (not an ftkit run)."""
    rd = RunDir(run_dir)
    try:
        spec = rd.read_spec()
    except (OSError, ValueError):
        return None
    try:
        raw = json.loads(rd.recipe.read_text())
    except FileNotFoundError:
        raw = spec.get("recipe")
    except (OSError, ValueError):
        return None
    hosts_raw = spec.get("hosts")
    if not isinstance(raw, dict) or not isinstance(hosts_raw, list):
        return None
    values: dict[str, Value] = {}
    for f in TOP_LEVEL:
        values[f.name] = _value(raw.get(f.name))
    has_peft = isinstance(raw.get("peft"), dict)
    for sec in SECTIONS:
        body = raw.get(sec.name)
        body = body if isinstance(body, dict) else {}
        for f in sec.fields:
            values[f"{sec.name}.{f.name}"] = _value(body.get(f.name, f.default))
    hosts = [(str(h[0]), as_int(h[1]) or 1) for h in hosts_raw if isinstance(h, list) and len(h) == 2]
    return Recipe(None, values, {}, has_peft=has_peft), hosts


def _value(v: object) -> Value:
    if isinstance(v, list):
        return [str(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


def points_json(points: list[CalPoint]) -> list[JSONObject]:
    return [p.as_json() for p in points]
