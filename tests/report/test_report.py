"""Issue 28: ``ftkit report`` (one HTML page of a run), goodput in ``ftkit status``, on hand-written records: the
goodput arithmetic (every category checked by hand), the command line's errors, the page of a hand-written run, the
plan record, a render that fails being one warning line. One real run, its page opened in headless Chromium:
tests/integration/report/test_report.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.errors import ExitCode
from ftkit.report import goodput
from ftkit.report.goodput import parse_metrics
from ftkit.rundir.layout import RunDir
from tests.helpers.cli import run_ftkit
from tests.helpers.runs import wait_for

# ------------------------------------------------------------------------------------------------ by hand


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _step(attempt: int, step: int, t: float, **kw) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "attempt": attempt, "time": t, "tokens_seen": 100 * step, **kw}


# A rank dies after step 6 of attempt 0 (checkpoint-4 committed); attempt 1 resumes from step 4, evaluates and saves
# at step 8, saves at 10 and finishes. One logged step per second; saves 0.5 s; the evaluation 0.25 s.
EVENTS = [
    {"time": 100.0, "event": "preflight", "attempt": 0},
    {"time": 100.0, "event": "plan", "attempt": 0, "hosts": [["localhost", 2]], "world_size": 2},
    {"time": 100.0, "event": "fresh_start", "attempt": 0},
    {"time": 100.0, "event": "launch", "attempt": 0},
    {"time": 130.0, "event": "failure", "attempt": 0, "kind": "exit", "step": 6, "exit_code": 247},
    {"time": 131.0, "event": "teardown", "attempt": 0},
    {"time": 132.0, "event": "restart", "attempt": 0, "restarts": 1, "delay_s": 2.0},
    {"time": 134.5, "event": "checkpoint_chosen", "attempt": 1, "step": 4},
    {"time": 135.0, "event": "launch", "attempt": 1},
    {"time": 170.0, "event": "teardown", "attempt": 1},
    {"time": 171.0, "event": "finished", "attempt": 1, "step": 10},
]
METRICS = [
    *[_step(0, s, 109.0 + s) for s in range(1, 7)],  # steps 1-6 at 110..115
    {"event": "commit", "step": 4, "commit_s": 0.1, "attempt": 0, "time": 113.5},
    *[_step(1, s, 145.0 + s) for s in range(5, 11)],  # steps 5-10 at 150..155
    {"step": 8, "eval_loss": 4.0, "attempt": 1, "time": 153.25},
    {"event": "commit", "step": 8, "commit_s": 0.1, "attempt": 1, "time": 153.5},
    {"event": "commit", "step": 10, "commit_s": 0.1, "attempt": 1, "time": 155.5},
]
EXPECTED = {
    "productive": 3.0 + 4.5,  # attempt 0: steps 2-4 (1 s each); attempt 1: steps 6-10 less the 0.5 s in step 9's
    "startup": 10.0 + 1.0 + 15.0,  # launch -> first step, twice; restart + backoff -> the next launch: 1 s
    "recomputed": 0.5 + 1.0,  # attempt 0's steps 5 (less its 0.5 s save) and 6
    "saves": 0.5 + 0.25 + 0.5,  # checkpoint-4; checkpoint-8 after its evaluation; checkpoint-10
    "evaluation": 0.25,
    "detection": 15.0,  # step 6 at 115 -> the failure at 130
    "teardown": 2.0 + 14.5 + 1.0,  # failure -> restart; checkpoint-10 -> teardown -> finished
    "backoff": 2.0,
    "other": 0.0,
}


def test_goodput_by_hand_every_category():
    g = goodput(EVENTS, METRICS)
    assert g.wall_s == pytest.approx(71.0)
    assert {k: round(v, 6) for k, v in g.breakdown.items()} == pytest.approx(EXPECTED)
    assert sum(g.breakdown.values()) == pytest.approx(g.wall_s)
    assert g.ratio == pytest.approx(7.5 / 71)
    assert g.largest_loss == ("startup", pytest.approx(26.0))
    assert g.line() == "goodput: 10.6% (productive training 7.5 s of 71.0 s wall; largest loss: start-up 26.0 s)"
    a0, a1 = g.attempts
    assert (a0.resume_step, a0.kept_until, a0.kept_steps, a0.recomputed_steps) == (0, 4, 4, 2)
    assert (a1.resume_step, a1.kept_steps, a1.recomputed_steps) == (4, 6, 0)
    # throughput: only the intervals with no save or evaluation in them give the median step time
    assert a1.median_step_s == pytest.approx(1.0)
    assert a1.tokens_per_s == pytest.approx(500 / 4.5)  # 5 steps of 100 tokens over 4.5 s of step time
    d = g.as_dict()
    assert d["ratio"] == pytest.approx(0.105634, abs=1e-6) and d["largest_loss"]["category"] == "startup"
    assert d["line"] == g.line()


def test_logging_steps_above_one_keeps_the_share_before_the_resume_step():
    events = [
        {"time": 0.0, "event": "fresh_start", "attempt": 0},
        {"time": 0.0, "event": "launch", "attempt": 0},
        {"time": 20.0, "event": "failure", "attempt": 0},
        {"time": 21.0, "event": "restart", "attempt": 0, "delay_s": 0},
        {"time": 21.0, "event": "checkpoint_chosen", "attempt": 1, "step": 6},
        {"time": 21.0, "event": "launch", "attempt": 1},
        {"time": 40.0, "event": "finished", "attempt": 1},
    ]
    metrics = [_step(0, 1, 10.0), _step(0, 4, 13.0), _step(0, 8, 17.0), _step(1, 8, 35.0), _step(1, 12, 39.0)]
    g = goodput(events, metrics)
    # attempt 0: (1,4] 3 s kept; (4,8] 4 s, resumed from 6: half kept. attempt 1: (8,12] 4 s kept.
    assert g.breakdown["productive"] == pytest.approx(3 + 2 + 4)
    assert g.breakdown["recomputed"] == pytest.approx(2)
    assert sum(g.breakdown.values()) == pytest.approx(g.wall_s) == pytest.approx(40.0)


def test_a_start_that_hangs_is_a_hang_and_one_that_fails_is_start_up():
    events = [
        {"time": 0.0, "event": "fresh_start", "attempt": 0},
        {"time": 0.0, "event": "launch", "attempt": 0},
        {"time": 240.0, "event": "failure", "attempt": 0, "kind": "startup"},
        {"time": 241.0, "event": "restart", "attempt": 0, "delay_s": 1.0},
        {"time": 242.0, "event": "fresh_start", "attempt": 1},
        {"time": 242.0, "event": "launch", "attempt": 1},
        {"time": 250.0, "event": "failure", "attempt": 1, "kind": "script_error"},
        {"time": 251.0, "event": "gave_up", "attempt": 1},
    ]
    g = goodput(events, [])
    assert g.breakdown["detection"] == pytest.approx(240.0) and g.breakdown["startup"] == pytest.approx(8.0)
    assert g.breakdown["teardown"] == pytest.approx(1.0 + 1.0) and g.breakdown["backoff"] == pytest.approx(1.0)
    assert g.largest_loss == ("detection", pytest.approx(240.0))


def test_a_later_launch_counts_from_its_own_first_event_and_a_live_one_until_its_newest_record():
    first = [
        {"time": 0.0, "event": "fresh_start", "attempt": 0},
        {"time": 0.0, "event": "launch", "attempt": 0},
        {"time": 10.0, "event": "teardown", "attempt": 0},
        {"time": 10.0, "event": "stopped", "attempt": 0},
    ]
    second = [
        {"time": 5000.0, "event": "checkpoint_chosen", "attempt": 1, "step": 3},
        {"time": 5000.0, "event": "launch", "attempt": 1},
    ]
    metrics = [_step(0, s, 4.0 + s) for s in (1, 2, 3)] + [_step(1, s, 5006.0 + s) for s in (4, 5, 6)]
    g = goodput(first + second, metrics)
    assert g.launches == 2 and g.live
    assert g.idle_s == pytest.approx(4990.0)  # between the launches: not wall time
    assert g.wall_s == pytest.approx(10.0 + 12.0)  # the live launch lasts until its newest record (step 6)
    assert g.productive_s == pytest.approx(2.0 + 2.0)
    assert g.line().endswith(" so far")
    assert sum(g.breakdown.values()) == pytest.approx(g.wall_s)


def test_no_events_no_goodput_and_malformed_records_are_left_out():
    assert goodput([], []).ratio is None
    assert goodput([], []).line() == "goodput: n/a (no time recorded yet)"
    m = parse_metrics([{"step": "x", "loss": 1, "time": 1}, {"step": 1, "loss": None, "time": 1}, {"loss": 1.0}])
    assert not m.steps and not m.evals and not m.commits


def test_a_long_run_draws_at_most_max_points_per_line_and_keeps_the_last():
    from ftkit.report.charts import MAX_POINTS, thin

    for n in (0, 5, MAX_POINTS, MAX_POINTS + 1, 10 * MAX_POINTS + 7):
        got = thin(list(range(n)))
        assert len(got) <= MAX_POINTS + 1 and got[-1:] == list(range(n))[-1:] and got[:1] == list(range(n))[:1]


def _hand_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    _jsonl(run / "events.jsonl", EVENTS)
    _jsonl(run / "metrics.jsonl", METRICS)
    (run / "ftkit").mkdir(exist_ok=True)
    return run


def test_status_prints_the_goodput_line_and_json_has_it(tmp_path):
    run = _hand_run(tmp_path)
    out = run_ftkit("status", str(run))
    assert out.returncode == 0, out.stderr
    assert "goodput: 10.6% (productive training 7.5 s of 71.0 s wall; largest loss: start-up 26.0 s)" in out.stdout
    out = run_ftkit("status", str(run), "--json")
    g = json.loads(out.stdout)["goodput"]
    assert g["ratio"] == pytest.approx(7.5 / 71, abs=1e-6) and g["breakdown_s"]["detection"] == pytest.approx(15)


_PROBE = """
import sys
from ftkit.cli.main import cli
try:
    cli(sys.argv[1:], standalone_mode=False)
except SystemExit:
    pass
print("HEAVY=" + ",".join(m for m in ("matplotlib", "torch", "transformers", "deepspeed") if m in sys.modules),
      file=sys.stderr)
"""


def test_status_without_plot_imports_no_matplotlib_or_torch(tmp_path):
    run = _hand_run(tmp_path)
    for args in (["status", str(run)], ["status", str(run), "--json"], ["report", "--help"]):
        out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=60)
        assert [x for x in out.stderr.splitlines() if x.startswith("HEAVY=")] == ["HEAVY="], out.stderr[-2000:]


@pytest.mark.heavy  # draws the page with matplotlib (seconds)
def test_report_of_a_hand_written_run_is_one_self_contained_page(tmp_path):
    run = _hand_run(tmp_path)
    out = run_ftkit("report", str(run))
    assert out.returncode == 0, out.stderr
    page = run / "report.html"
    assert out.stdout.strip() == f"wrote {page}"
    text = page.read_text()
    for section in ("goodput", "loss", "timeline", "throughput", "hosts", "checkpoints", "plan"):
        assert f'<section id="{section}">' in text, section
    assert "<script" not in text and "src=" not in text
    assert all(h.startswith("#") for h in _attr_values(text, "href")), "a link out of the page"
    assert 'id="loss-attempt-0"' in text and 'id="recomputed-attempt-0"' in text and 'id="eval-loss"' in text
    assert "10.6%" in text and "start-up" in text
    assert not list(run.glob(".report.html.*")), "the temp file of the atomic write is left"


def _made(path: Path, make) -> Path:
    make(path)
    return path


def _attr_values(text: str, name: str) -> list[str]:
    import re

    return re.findall(rf'{name}="([^"]*)"', text)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: _made(p / "file", lambda f: f.write_text("x")), "not a directory"),
        (lambda p: _made(p / "empty", Path.mkdir), "not an ftkit run directory"),
    ],
    ids=["missing", "file", "not-a-run"],
)
def test_report_refuses_what_is_not_a_run_directory_in_one_line(tmp_path, make, says):
    out = run_ftkit("report", str(make(tmp_path)))
    assert out.returncode == ExitCode.USAGE
    assert out.stderr.count("\n") == 1 and says in out.stderr and out.stderr.startswith("ftkit: error:"), out.stderr


def test_report_to_an_unwritable_place_is_one_line(tmp_path):
    run = _hand_run(tmp_path)
    (tmp_path / "afile").write_text("")
    out = run_ftkit("report", str(run), "-o", str(tmp_path / "afile" / "report.html"))
    assert out.returncode == ExitCode.USAGE and out.stderr.count("\n") == 1, out.stderr


def test_a_render_that_fails_is_one_warning_line(tmp_path):
    from ftkit.report import ReportRefresher

    said: list[str] = []
    rd = RunDir(tmp_path / "not-a-run")  # ftkit report refuses it (exit 2)
    (rd.path / "ftkit").mkdir(parents=True)
    (rd.path / "events.jsonl").mkdir()  # a directory where the events belong: unreadable
    r = ReportRefresher(rd, said.append)
    r.refresh()
    r.finish(timeout_s=60)
    assert len(said) == 1 and said[0].startswith("ftkit: warning: could not write"), said
    assert "events.jsonl" in said[0], said


@pytest.mark.heavy  # draws the page with matplotlib (seconds)
def test_attempts_seconds_apart_render_once_a_minute_and_the_end_always(tmp_path):
    """A crash loop of attempts seconds apart used to start a render (matplotlib, a CPU-second or two) after every
    attempt; now at most one a minute: an attempt's end within a minute of the launch's start (or of the last render)
    defers its render to that minute's end, and the launch's end renders at once, with no deferred one left."""
    from ftkit.report import ReportRefresher

    rd = RunDir(tmp_path / "run")
    (rd.path / "ftkit").mkdir(parents=True)
    log = rd.meta / "report.log"  # every render writes its stderr there from its start
    r = ReportRefresher(rd, lambda _line: None, every_s=60.0)
    r.refresh()
    r.refresh()
    assert r.skipped == 2 and r.pending and not log.exists(), "a render within a minute of the launch's start"
    r.finish(timeout_s=60)
    assert log.exists() and not r.pending, "the launch's end renders, however soon, and cancels the deferred one"


@pytest.mark.heavy  # draws the page with matplotlib (seconds)
def test_an_attempt_ending_soon_after_a_render_gets_its_own_render_when_the_interval_is_over(tmp_path):
    """A first attempt that fails seconds into a launch, then an attempt that trains for hours: its page is rendered
    every_s after the launch's start, not only when the launch ends (the deferred render, on a timer)."""
    from ftkit.report import ReportRefresher

    rd = RunDir(tmp_path / "run")
    (rd.path / "ftkit").mkdir(parents=True)
    log = rd.meta / "report.log"
    r = ReportRefresher(rd, lambda _line: None, every_s=1.0)
    t0 = time.monotonic()
    r.refresh()
    assert r.pending and not log.exists()
    wait_for(log.exists, 30, "the deferred render", poll=0.05)
    assert time.monotonic() - t0 >= 0.9, "the deferred render came too early"
    assert not r.pending
    r.finish(timeout_s=60)


def test_ftkit_report_off_leaves_the_page_to_ftkit_report_and_another_value_is_one_warning(tmp_path):
    from ftkit.report import REPORT_ENV, ReportRefresher, launch_refresher

    rd = RunDir(tmp_path / "run")
    said: list[str] = []
    assert launch_refresher(rd, said.append, {REPORT_ENV: "off"}) is None
    assert launch_refresher(rd, said.append, {REPORT_ENV: " OFF "}) is None
    assert isinstance(launch_refresher(rd, said.append, {}), ReportRefresher)
    assert isinstance(launch_refresher(rd, said.append, {REPORT_ENV: "auto"}), ReportRefresher)
    assert not said
    assert isinstance(launch_refresher(rd, said.append, {REPORT_ENV: "no"}), ReportRefresher)
    assert said == [f"ftkit: warning: {REPORT_ENV}='no' is neither auto nor off: report.html is kept current"]


def test_plan_record_has_the_compute_model_and_the_memory(write_recipe):
    from ftkit.plan.plan import build_plan
    from ftkit.recipe.load import load_recipe
    from ftkit.report import plan_record

    recipe = write_recipe("""\
        model:
          path: ./model
        data:
          train: ./data.jsonl
        train:
          output_dir: ./run
          micro_batch_size: 2
          global_batch_size: 16
        zero:
          stage: 2
        cluster:
          gpus_per_node: 8
          gpu: a100
        """)
    plan = build_plan(load_recipe(str(recipe)))
    memory = plan.memory
    rec = plan_record(plan)
    assert plan.memory is memory, "the record must not change the launch's plan"
    assert rec["stage"] == 2 and rec["world_size"] == 8 and rec["hosts"] == [["localhost", 8]]
    assert rec["peak_tflops"] == 312.0 and rec["gpu"] == "a100"
    assert rec["flops_per_token"] > 0 and rec["predicted_step_s"] > 0 and rec["memory_gib_per_gpu"] > 0
    assert "not_estimated" not in rec
    json.dumps(rec)  # it goes into events.jsonl


# ------------------------------------------------------------------------------------------------ where it writes


@pytest.mark.heavy
def test_report_never_writes_into_a_runs_state_nor_over_what_it_did_not_write(tmp_path):
    """Issue 36, item 3: `-o` overwrote any file (events.jsonl, the final model, the spec) and created a missing
    directory. Refused now, nothing changed: the run's own state even with --force; a file that is not a report
    page without --force; a directory that does not exist."""
    from ftkit.errors import UserError
    from ftkit.report import write_report

    run = _hand_run(tmp_path)
    (run / "ftkit" / "spec.json").write_text('{"name": "x"}')
    (run / "final").mkdir()
    (run / "final" / "model.safetensors").write_bytes(b"weights")
    (run / "logs").mkdir()
    mine = tmp_path / "notes.html"
    mine.write_text("<p>my own notes</p>")
    (tmp_path / "link.html").symlink_to(run / "metrics.jsonl")  # a link to the state is the state
    before = {p: p.read_bytes() for p in [*run.rglob("*"), mine] if p.is_file()}
    state = [
        run / "events.jsonl",
        run / "metrics.jsonl",
        run / "ftkit" / "spec.json",
        run / "final" / "model.safetensors",
        run / "logs" / "page.html",
        run / "ftkit" / "new.html",
        run / "checkpoint-4",
        tmp_path / "link.html",
    ]
    for target in state:
        for force in (False, True):
            with pytest.raises(UserError, match="the run's own state"):
                write_report(run, target, force=force)
    with pytest.raises(UserError, match=r"is not a report page ftkit wrote \(--force replaces it\)"):
        write_report(run, mine)
    missing = tmp_path / "nonexistent" / "x.html"
    with pytest.raises(UserError, match="does not exist"):
        write_report(run, missing)
    assert not missing.parent.exists()
    assert {p: p.read_bytes() for p in [*run.rglob("*"), mine] if p.is_file()} == before
    assert not (run / "logs" / "page.html").exists() and not (run / "ftkit" / "new.html").exists()
    # on the command line: one line, exit 2
    out = run_ftkit("report", str(run), "-o", str(run / "events.jsonl"), "--force")
    assert out.returncode == ExitCode.USAGE and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"ftkit: error: {run / 'events.jsonl'} -o: is inside"), out.stderr
    # its own pages are replaced (the default, and -o twice); --force replaces the user's file
    for out_path in (None, tmp_path / "page.html", tmp_path / "page.html"):
        write_report(run, out_path)
    write_report(run, mine, force=True)
    assert mine.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.heavy
def test_dollar_signs_in_host_and_run_directory_names_are_text_not_mathtext(tmp_path):
    """Issue 36, item 15: a host named `n$\\frac{1}{$x` crashed `ftkit report` (matplotlib parsed it as mathtext)."""
    from ftkit.report import build_report

    host = "n$\\frac{1}{$x"
    run = tmp_path / "run$\\alpha{$"
    events = [dict(e) for e in EVENTS]
    events[1]["hosts"] = [[host, 2]]
    times = [{"host": host, "compute_s": 0.5, "ranks": [0, 1]}, {"host": "b$_", "compute_s": 0.25, "ranks": [2]}]
    events.insert(6, {"time": 131.0, "event": "step_times", "attempt": 0, "hosts": times})  # after its teardown
    _jsonl(run / "events.jsonl", events)
    _jsonl(run / "metrics.jsonl", METRICS)
    (run / "ftkit").mkdir()
    page = build_report(run)
    assert page.count("n$\\frac{1}{$x") >= 2 and "b$_" in page  # the timeline's and the host chart's labels, as text


@pytest.mark.heavy
def test_a_launch_killed_with_its_ranks_and_a_relaunch_are_two_launches_that_add_up_to_the_wall_time(tmp_path):
    """Issue 36, item 10: kill -9 of the whole launch (no outcome recorded), then a relaunch. The two launches were
    read as one: the killed attempt lasted until the end of the relaunch, the breakdown added up to 140% of the
    wall time, and the card said "1 launch"."""
    from ftkit.report import build_report

    killed = [
        {"time": 0.0, "event": "preflight", "attempt": 0},
        {"time": 0.0, "event": "plan", "attempt": 0, "hosts": [["localhost", 2]], "world_size": 2},
        {"time": 0.5, "event": "fresh_start", "attempt": 0},
        {"time": 1.0, "event": "launch", "attempt": 0},
        {"time": 1.5, "event": "spawn", "attempt": 0, "host": "localhost"},
    ]  # SIGKILLed after step 10, with its ranks: nothing more
    relaunch = [
        {"time": 100.0, "event": "preflight", "attempt": 1},
        {"time": 100.0, "event": "plan", "attempt": 1, "hosts": [["localhost", 2]], "world_size": 2},
        {"time": 101.0, "event": "checkpoint_chosen", "attempt": 1, "step": 5},
        {"time": 101.0, "event": "launch", "attempt": 1},
        {"time": 117.0, "event": "teardown", "attempt": 1},
        {"time": 118.0, "event": "finished", "attempt": 1, "step": 12},
    ]
    metrics = [_step(0, s, 9.0 + s) for s in range(1, 11)]  # steps 1-10 at 10..19
    metrics.append({"event": "commit", "step": 5, "commit_s": 0.1, "attempt": 0, "time": 14.5})
    metrics += [_step(1, s, 104.0 + s) for s in range(6, 13)]  # steps 6-12 at 110..116
    g = goodput(killed + relaunch, metrics)
    assert g.launches == 2 and not g.live
    assert g.wall_s == pytest.approx(19.0 + 18.0)  # the killed launch lasts until its newest record (step 10)
    assert g.idle_s == pytest.approx(81.0)
    assert sum(g.breakdown.values()) == pytest.approx(g.wall_s)
    assert g.productive_s == pytest.approx(4.0 + 6.0)  # steps 2-5, then 7-12
    assert g.breakdown["recomputed"] == pytest.approx(0.5 + 4.0)  # steps 6 (less its save) to 10
    a0, a1 = g.attempts
    assert a0.end == pytest.approx(19.0) and a0.outcome == "no outcome (its ftkit launch was killed)"
    assert a1.outcome == "finished"
    run = tmp_path / "run"
    _jsonl(run / "events.jsonl", killed + relaunch)
    _jsonl(run / "metrics.jsonl", metrics)
    (run / "ftkit").mkdir()
    page = build_report(run)
    assert "<span>2 launches</span>" in page, page[:3000]


@pytest.mark.heavy
def test_one_diverged_loss_is_marked_off_the_chart_instead_of_flattening_it():
    """Issue 36: one loss of 1e6 among losses of 3 to 5 set the loss chart's scale, and the curve was a flat line
    at its bottom. The axis keeps to the curve; the diverged step is a marker at the top edge, with its value."""
    from ftkit.report.charts import loss_axis, loss_chart

    metrics = [_step(0, s, 10.0 + s) for s in range(1, 51)]  # losses 4.9 .. 0.0
    metrics[29]["loss"] = 1e6  # step 30 diverged
    events = [{"time": 0.0, "event": "fresh_start", "attempt": 0}, {"time": 0.0, "event": "launch", "attempt": 0}]
    g = goodput(events, metrics)
    axis = loss_axis(g.attempts)
    assert axis.off == [(30, 1e6)]
    assert axis.top is not None and 4.9 < axis.top < 6.0
    svg = loss_chart(g.attempts)
    assert 'id="loss-off-chart"' in svg and "1 step(s) off the chart" in svg and "(largest 1e+06 at step 30)" in svg
    # a healthy curve is never cut: one that starts high and stays low for long, and one that only goes down
    flat = [_step(0, 1, 11.0, loss=11.0)] + [_step(0, s, 11.0 + s, loss=2.0) for s in range(2, 10_001)]
    assert loss_axis(goodput(events, flat).attempts).off == []
    metrics[29]["loss"] = 2.0
    assert loss_axis(goodput(events, metrics).attempts) == type(axis)(None, [])


@pytest.mark.heavy
def test_checkpoint_rows_say_which_tier_and_a_long_run_lists_the_newest(tmp_path):
    """Issue 36, item 10 and the million-step report: every checkpoint row said `durable`, the /dev/shm ones too;
    and every save was a row (a run saving every step made a 43 MB page)."""
    from ftkit.report.page import MAX_CHECKPOINT_ROWS, build_report, checkpoint_rows
    from tests.helpers.ckpt import commit, make_ckpt

    run = tmp_path / "run"
    events = [{"time": 0.0, "event": "fresh_start", "attempt": 0}, {"time": 0.0, "event": "launch", "attempt": 0}]
    metrics = []
    for s in range(1, 301):  # a local save every step, a durable copy every 100 (published by the last node)
        metrics.append(_step(0, s, 1.0 + s))
        rotated = [f"/dev/shm/ftkit-x/localhost/checkpoint-{s - 2}"] if s > 2 else []
        metrics.append({"event": "commit", "step": s, "attempt": 0, "tier": "local", "rotated": rotated})
        metrics[-1]["time"] = s + 1.1
        if s % 100 == 0:
            metrics.append({"event": "durable", "step": s, "attempt": 0, "host": "localhost", "published": True})
            metrics[-1]["time"] = s + 1.5
    metrics.append({"event": "commit", "step": 300, "attempt": 0, "commit_s": 0.1, "time": 301.2})  # a direct save
    _jsonl(run / "events.jsonl", events)
    _jsonl(run / "metrics.jsonl", metrics)
    (run / "ftkit").mkdir()
    commit(make_ckpt(run, 200))
    g = goodput(events, metrics)
    table = checkpoint_rows(run, g, limit=10)
    rows = {r["name"]: r for r in table.rows}
    assert len(table.rows) <= 10 and table.unlisted == 300 - len(table.rows) and table.unlisted_local == table.unlisted
    assert rows["checkpoint-200"]["tier"] == "local, then durable" and rows["checkpoint-200"]["ok"] is True
    assert rows["checkpoint-299"]["tier"] == "local"
    assert rows["checkpoint-299"]["state"] == "in the local tier only (rotated, or removed with the tier)"
    assert "checkpoint-300" in rows and "checkpoint-100" not in rows  # the newest saves, and what is on disk
    direct = checkpoint_rows(run, goodput(events, [m for m in metrics if m.get("tier") != "local"]))
    assert [r["tier"] for r in direct.rows] == ["durable", "durable"]  # checkpoint-200 (on disk), -300
    page = build_report(run)
    assert page.count("<td>local</td>") == MAX_CHECKPOINT_ROWS - 3  # the newest, besides -200, -300 and the note
    assert "older save(s) not listed (" in page and "<td>local, then durable</td>" in page


def test_goodput_of_a_save_every_step_is_linear_in_the_steps():
    """The million-step report: every step interval was checked against every save (quadratic): 10,000 steps with a
    save each took two minutes. benchmarks/report_scale.py measures the whole report."""
    import time

    n = 20_000
    metrics = []
    for s in range(1, n + 1):
        metrics.append(_step(0, s, float(s)))
        metrics.append({"event": "commit", "step": s, "attempt": 0, "tier": "local", "time": s + 0.25})
    events = [{"time": 0.0, "event": "fresh_start", "attempt": 0}, {"time": 0.0, "event": "launch", "attempt": 0}]
    t0 = time.process_time()  # CPU time: a busy machine does not change it
    g = goodput(events, metrics)
    took = time.process_time() - t0
    assert g.breakdown["saves"] == pytest.approx(0.25 * n) and sum(g.breakdown.values()) == pytest.approx(g.wall_s)
    assert took < 10.0, f"goodput of {n} steps took {took:.1f} s"  # ~0.5 s here; quadratic it was minutes
