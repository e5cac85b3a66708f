"""Stop control (``ftkit.supervise.stopping.StopControl``): signals, the stop file and the stragglers a graceful stop
leaves out, on a run directory in tmp_path with a fake clock: no process is started, no signal is sent."""

from __future__ import annotations

import json
import signal

import pytest

from ftkit.rundir.layout import STOP_FILE, RunDir
from ftkit.supervise.decide import FailureKind
from ftkit.supervise.stopping import STOP_SIGNALS, STOP_TIMEOUT_S, StopControl
from ftkit.supervise.stragglers import HostScore, StragglerReport
from tests.supervise.test_resume import Recorded


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _control(tmp_path, timeout_s: float | None = 30.0, exclude: bool = False, min_nodes: int | None = None):
    rd = RunDir(tmp_path / "run")
    rd.meta.mkdir(parents=True)
    events, clock = Recorded(), Clock()
    return StopControl(rd, events, timeout_s, exclude, min_nodes, clock=clock), rd, events, clock


def _beats(*phases: str) -> list[dict[str, object]]:
    return [{"rank": r, "attempt": 0, "phase": p, "step": 3 if p == "train" else None} for r, p in enumerate(phases)]


def test_the_first_signal_asks_for_a_graceful_stop_and_the_second_ends_now(tmp_path):
    stop, *_ = _control(tmp_path)
    assert not stop.pending and stop.signum is None
    stop.on_signal(signal.SIGTERM, None)
    assert stop.requested == signal.SIGTERM and stop.interrupted is None and stop.pending
    stop.on_signal(signal.SIGINT, None)
    assert stop.requested == signal.SIGTERM and stop.interrupted == signal.SIGINT
    assert stop.signum == signal.SIGINT  # the one that ends the run names it (exit 128+N)


@pytest.mark.parametrize(
    ("phases", "at_once"),
    [
        (["starting", "loading"], True),
        (["train", "loading"], False),
        (["train", "train"], False),
        (["saving", "loading"], False),
    ],
    ids=["nobody-training", "one-training", "all-training", "saving"],
)
def test_a_stop_is_immediate_only_when_no_rank_has_begun_training(tmp_path, phases, at_once):
    """The decision is taken on this poll's heartbeats (it once used the previous poll's, and a stop right after
    the first steps ended at once and lost them): a rank in training gets the save request."""
    stop, rd, events, _ = _control(tmp_path)
    stop.on_signal(signal.SIGUSR1, None)
    failure = stop.poll(0, _beats(*phases))
    if at_once:
        assert failure is not None and failure.kind is FailureKind.STOPPED
        assert failure.message == "SIGUSR1 before training began: nothing new to save"
        assert not (rd.meta / STOP_FILE).exists() and events.lines == []
    else:
        assert failure is None and stop.sent_at == 100.0
        rec = json.loads((rd.meta / STOP_FILE).read_text())
        assert rec["attempt"] == 0 and rec["signal"] == "SIGUSR1" and rec["timeout_s"] == 30.0
        (line,) = events.lines
        assert line[0] == "stop_requested" and line[1] == (
            "SIGUSR1: every rank saves at the next step boundary, then stops (at most 30s; a second signal stops "
            "at once)"
        )


def test_the_stop_file_is_written_once_and_the_wait_is_bounded_by_stop_timeout_s(tmp_path):
    stop, rd, events, clock = _control(tmp_path, timeout_s=30.0)
    stop.on_signal(signal.SIGTERM, None)
    assert stop.poll(0, _beats("train", "train")) is None
    clock.now += 30.0
    assert stop.poll(0, _beats("train", "train")) is None  # at the bound, still waiting
    assert [e for e, _, _ in events.lines] == ["stop_requested"]
    clock.now += 0.5
    failure = stop.poll(0, _beats("train", "train"))
    assert failure is not None and failure.kind is FailureKind.INTERRUPTED
    assert failure.message == "the graceful stop did not finish within stop_timeout_s=30s: tearing down"
    assert stop.interrupted == signal.SIGTERM  # torn down as for the signal: exit 128+15


def test_a_recipe_without_stop_timeout_s_waits_the_default(tmp_path):
    stop, *_ = _control(tmp_path, timeout_s=None)
    assert stop.timeout_s == STOP_TIMEOUT_S


def test_a_new_attempt_forgets_the_previous_attempt_s_stop_file_and_stragglers(tmp_path):
    stop, *_ = _control(tmp_path)
    stop.sent_at, stop.exclude = 5.0, ["node1"]
    stop.new_attempt()
    assert stop.sent_at is None and stop.exclude == []


def _report(*slow: str) -> StragglerReport:
    """node0..node2, 50 steps each; the ``slow`` ones compute twice as long as the others' median."""
    scores = [HostScore(h, (i,), 2.0 if h in slow else 1.0, 1.0, 50) for i, h in enumerate(("node0", "node1", "node2"))]
    return StragglerReport(attempt=0, hosts=scores)


@pytest.mark.parametrize(
    ("exclude", "min_nodes", "requested", "left_out"),
    [(True, 2, False, ["node1"]), (True, None, False, []), (False, 2, False, []), (True, 2, True, [])],
    ids=["excluded", "min-nodes-unset", "option-off", "already-stopping"],
)
def test_a_straggler_is_left_out_only_when_asked_and_min_nodes_allows_it(tmp_path, exclude, min_nodes, requested,
                                                                         left_out):  # fmt: skip
    stop, rd, events, _ = _control(tmp_path, exclude=exclude, min_nodes=min_nodes)
    if requested:
        stop.on_signal(signal.SIGTERM, None)
    stop.exclude_stragglers(_report("node1"), ["node0", "node1", "node2"])
    assert stop.exclude == left_out
    if left_out:
        (line,) = events.lines
        assert line[1] == ("leaving out straggler(s) node1: saving the step in flight, then continuing on node0, node2")
        assert stop.poll(0, _beats("train")) is None  # the same graceful stop, named for what asked it
        assert json.loads((rd.meta / STOP_FILE).read_text())["signal"] == "straggler"
    else:
        assert events.lines == []


def test_no_report_or_no_straggler_leaves_nobody_out(tmp_path):
    stop, _, events, _ = _control(tmp_path, exclude=True, min_nodes=1)
    stop.exclude_stragglers(None, ["node0", "node1"])
    stop.exclude_stragglers(_report(), ["node0", "node1"])
    assert stop.exclude == [] and events.lines == []


def test_install_handles_the_stop_signals_and_release_restores_them_and_removes_the_stop_file(tmp_path):
    stop, rd, *_ = _control(tmp_path)
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    stop.install()
    try:
        assert all(signal.getsignal(s) == stop.on_signal for s in STOP_SIGNALS)
        (rd.meta / STOP_FILE).write_text("{}")
    finally:
        stop.release()
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before
    assert not (rd.meta / STOP_FILE).exists()
    stop.release()  # twice, and with no stop file: nothing to do
