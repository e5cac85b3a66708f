"""``ftkit report`` and goodput on one real run, shared by the module: 2 CPU ranks, a rank SIGKILLed by fault
injection at step 6 (restart from checkpoint-4, steps 5-6 recomputed), evaluation every 4 steps, then a graceful stop
(SIGTERM, exit 8). On it: goodput from the library equals an independent computation within 1%, ``ftkit status``
prints the goodput line and ``--json`` has it, the launch refreshed ``RUN/report.html``, and headless Chromium opens
the page with no console error and no network request, shows the curves and the timeline, and takes a screenshot
(in the test's tmp dir). The arithmetic and the page on hand-written records are tests/report/test_report.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from ftkit.errors import ExitCode
from ftkit.report import goodput
from ftkit.run.status import read_jsonl
from tests.helpers.cli import run_ftkit
from tests.helpers.runs import RUN_ENV

STOP_AT = 14  # attempt 1's step when SIGTERM arrives: the graceful stop saves the next one
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def story(fx, tmp_path_factory) -> dict:
    """One real run: a rank killed at step 6 (restart from checkpoint-4), evaluations, then a graceful stop."""
    from tests.helpers.runs import (
        assert_no_process_left,
        heartbeat_step,
        kill_tree,
        mp_lock,
        start_ftkit,
        wait_for,
        write_recipe,
    )

    d = tmp_path_factory.mktemp("report-story")
    recipe = write_recipe(
        d,
        fx,
        data__eval=str(fx["data"]),
        train__max_steps=40,
        train__save_steps=4,
        train__eval_steps=4,
    )
    run = d / "run"
    log = d / "ftkit.log"
    env = {**RUN_ENV, **OFFLINE, "FTKIT_FAULT_INJECT": "kill:1:6", "FTKIT_REPORT": "auto"}  # the suite's is off
    with mp_lock():
        t0 = time.monotonic()
        proc = start_ftkit("launch", str(recipe), env=env, log=log)
        try:
            wait_for(lambda: heartbeat_step(run, 0, attempt=1) >= STOP_AT, 300, f"attempt 1 at step {STOP_AT}")
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(180)
        except BaseException:
            kill_tree(proc)
            raise
        took = time.monotonic() - t0
    text = log.read_text(errors="replace")
    assert code == ExitCode.STOPPED, text[-4000:]
    assert_no_process_left(run)
    assert not _renders_left(run), "a report render outlived the launch"
    return {"run": run, "log": text, "took": took}


def _renders_left(run: Path) -> list[int]:
    left = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"report" in argv and str(run).encode() in argv:
            left.append(int(p.name))
    return left


def _independent_goodput(run: Path) -> tuple[float, float, float]:
    """(productive, wall, ratio) computed directly from the files, as the issue states it, for logging_steps 1:
    wall = last event - first event (one launch); productive = over the logged steps no later attempt recomputed,
    the time since the attempt's previous logged step, less the evaluation and save that HF Trainer ran right after
    that previous step (from its log record to its eval_loss record, then to its commit record)."""
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    wall = events[-1]["time"] - events[0]["time"]
    resumed = {e["attempt"]: e["step"] for e in events if e["event"] == "checkpoint_chosen"}
    resumed.update({e["attempt"]: 0 for e in events if e["event"] == "fresh_start"})
    attempts = sorted({r["attempt"] for r in rows})
    productive = 0.0
    for a in attempts:
        later = [resumed[b] for b in attempts if b > a]
        keep_until = min(later) if later else float("inf")
        logs = sorted((r["time"], r["step"]) for r in rows if r["attempt"] == a and "loss" in r)
        evals = {r["step"]: r["time"] for r in rows if r["attempt"] == a and "eval_loss" in r}
        commits = {r["step"]: r["time"] for r in rows if r["attempt"] == a and r.get("event") == "commit"}
        logged = {step: t for t, step in logs}
        for (t_prev, s_prev), (t, s) in zip(logs, logs[1:], strict=False):
            if s > keep_until:
                continue
            busy = 0.0
            after = logged[s_prev]
            if s_prev in evals:
                busy += evals[s_prev] - after
                after = evals[s_prev]
            if s_prev in commits:
                busy += commits[s_prev] - after
            productive += (t - t_prev) - busy
    return productive, wall, productive / wall


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_goodput_equals_the_kept_step_intervals_over_the_wall_time(story):
    run = story["run"]
    g = goodput(read_jsonl(run / "events.jsonl"), read_jsonl(run / "metrics.jsonl"))
    productive, wall, ratio = _independent_goodput(run)
    assert g.wall_s == pytest.approx(wall, rel=1e-9)
    assert g.ratio == pytest.approx(ratio, rel=0.01), (g.as_dict(), productive, wall)
    assert g.productive_s == pytest.approx(productive, rel=0.01)
    assert sum(g.breakdown.values()) == pytest.approx(g.wall_s, rel=1e-9)
    b = g.breakdown
    assert b["recomputed"] > 0 and b["saves"] > 0 and b["evaluation"] > 0 and b["detection"] > 0, b
    assert b["startup"] > b["productive"], b  # two DeepSpeed start-ups of ~10 s against ~0.15 s steps
    a0, a1 = g.attempts
    assert a0.outcome == "failed (exit)" and a1.outcome == "stopped"
    assert a0.kept_until == 4 and a0.recomputed_steps >= 1 and a1.recomputed_steps == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_status_prints_goodput_of_the_real_run(story):
    run = story["run"]
    out = run_ftkit("status", str(run))
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("goodput: "))
    assert "largest loss: start-up" in line, line
    data = json.loads(run_ftkit("status", str(run), "--json").stdout)
    assert data["goodput"]["line"] == line and 0 < data["goodput"]["ratio"] < 1
    assert story["log"].count("goodput: ") == 1  # the launch's own summary has it too


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_launch_refreshed_report_html_at_its_end(story):
    run = story["run"]
    page = run / "report.html"
    assert page.is_file(), story["log"][-3000:]
    text = page.read_text()
    assert "stop_requested" in text and 'id="timeline-chart"' in text
    stopped = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()][-1]
    assert stopped["event"] == "stopped" and page.stat().st_mtime >= stopped["time"]
    assert "warning: could not write" not in story["log"]


FACTS = """(() => {
  const ids = sel => Array.from(document.querySelectorAll(sel)).map(e => e.id);
  const paths = sel => document.querySelectorAll(sel + ' path, ' + sel + ' use').length;
  const box = id => { const e = document.getElementById(id); if (!e) return null;
                      const r = e.getBoundingClientRect(); return [Math.round(r.width), Math.round(r.height)]; };
  const rows = sel => Array.from(document.querySelectorAll(sel + ' tbody tr')).map(
      tr => Array.from(tr.cells).map(td => td.textContent.trim()));
  return {
    charts: ids('svg.chart'),
    loss: ids('#loss-chart [id^="loss-attempt-"]'),
    loss_paths: paths('#loss-attempt-0') + paths('#loss-attempt-1'),
    recomputed: ids('#loss-chart [id^="recomputed-attempt-"]'),
    bands: ids('#loss-chart [id^="recomputed-band-"]'),
    eval_paths: paths('#eval-loss'),
    bars: ids('#timeline-chart [id^="timeline-"]'),
    marks: ids('#timeline-chart [id^="mark-"]'),
    boxes: {loss: box('loss-chart'), timeline: box('timeline-chart'), breakdown: box('breakdown-chart')},
    events: rows('table.events').map(r => r[3]),
    throughput: rows('table.throughput'),
    checkpoints: rows('table.checkpoints'),
    cards: Array.from(document.querySelectorAll('#summary .card')).map(c => c.textContent),
    scripts: document.scripts.length,
    title: document.title,
  };
})()"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_report_opens_offline_in_headless_chromium(story, tmp_path):
    from tests.helpers.browser import browser, visit

    run = story["run"]
    page = tmp_path / "report.html"
    t0 = time.monotonic()
    out = run_ftkit("report", str(run), "-o", str(page))
    render_s = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    url = page.resolve().as_uri()
    with browser(tmp_path) as d:
        v = visit(d, url, FACTS, tmp_path / "report.png", tmp_path / "report.pdf")
    assert v.errors == [], v.errors
    assert v.requests == [url], f"requests besides the page itself: {[r for r in v.requests if r != url]}"
    f = v.facts
    assert f["scripts"] == 0
    assert {"breakdown-chart", "loss-chart", "timeline-chart"} <= set(f["charts"]), f["charts"]
    # the curves: both attempts' losses, attempt 0's recomputed steps over a band, the evaluations
    assert f["loss"] == ["loss-attempt-0", "loss-attempt-1"] and f["loss_paths"] >= 2, f
    assert f["recomputed"] == ["recomputed-attempt-0"] and f["bands"] == ["recomputed-band-0"], f
    assert f["eval_paths"] >= 1, f
    # the timeline: start-up and training of both attempts on the host, the restart's backoff, the decisions
    for bar in ("timeline-startup-attempt-0-0", "timeline-training-attempt-1-0", "timeline-backoff-attempt-0-0"):
        assert bar in f["bars"], (bar, f["bars"])
    kinds = {m.rsplit("-", 1)[0] for m in f["marks"]}
    assert {"mark-failure", "mark-restart", "mark-stop_requested", "mark-stopped"} <= kinds, f["marks"]
    for chart, (w, h) in f["boxes"].items():
        assert w >= 600 and h >= 60, (chart, w, h)  # drawn at the page's width, not collapsed
    assert [e for e in f["events"] if e in ("failure", "restart", "stop_requested", "stopped")] == [
        "failure",
        "restart",
        "stop_requested",
        "stopped",
    ], f["events"]
    assert [r[0] for r in f["throughput"]] == ["0", "1"]
    assert all("n/a (CPU ranks" in r[-1] for r in f["throughput"]), f["throughput"]  # no made-up MFU on CPU
    stop_rows = [r for r in f["checkpoints"] if "graceful stop" in r[6]]
    assert len(stop_rows) == 1 and stop_rows[0][2] == "durable" and "verified (sizes)" in stop_rows[0][7], f
    assert any(c.startswith("goodput") and "%" in c for c in f["cards"]), f["cards"]
    shot = tmp_path / "report.png"
    assert shot.stat().st_size > 50_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "report.pdf").read_bytes()[:5] == b"%PDF-"
    print(f"report: rendered in {render_s:.2f}s, {page.stat().st_size} bytes; screenshot {shot}")
    if os.environ.get("FTKIT_KEEP_REPORT"):  # for a person to look at: FTKIT_KEEP_REPORT=DIR
        import shutil

        for name in ("report.html", "report.png", "report.pdf"):
            shutil.copy(tmp_path / name, Path(os.environ["FTKIT_KEEP_REPORT"]) / name)
