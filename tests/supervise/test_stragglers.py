"""Stragglers from real heartbeat and pid-record files, written here as the ranks write them (ftkit.hf). With real
ranks: tests/integration/stragglers/."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftkit.rundir.layout import RunDir
from ftkit.supervise.stragglers import MIN_STEPS, SLOW_FACTOR, StragglerWatch, hosts_to_exclude, score, score_run
from tests.helpers.rundir import write_rank


def two_hosts(tmp_path: Path, slow: float, n: int = 12, attempt: int = 0) -> RunDir:
    rd = RunDir(tmp_path / "run")
    for rank, host, c in [(0, "n1", 0.40), (1, "n1", 0.42), (2, "n2", 0.40 * slow), (3, "n2", 0.41 * slow)]:
        write_rank(rd, rank, host, c, n, attempt)
    return rd


def test_a_host_twice_as_slow_is_named_with_numbers(tmp_path):
    rd = two_hosts(tmp_path, slow=2.0)
    report = score_run(rd.path)
    assert [h.host for h in report.stragglers] == ["n2"]
    (n2,) = report.stragglers
    assert n2.ranks == (2, 3) and n2.score == pytest.approx(0.81 / 0.41) and n2.steps == 12
    assert report.lines() == [
        "straggler: host n2 (ranks 2, 3): 0.81 s compute per step, 1.98x the other hosts' median 0.41 s, "
        f"over 12 steps (threshold {SLOW_FACTOR}x after {MIN_STEPS} steps)"
    ]
    fast = next(h for h in report.hosts if h.host == "n1")
    assert not fast.straggler and fast.score == pytest.approx(0.41 / 0.81)


@pytest.mark.parametrize(("slow", "n", "named"), [(1.4, 50, False), (1.5, 50, True), (3.0, MIN_STEPS - 1, False)])
def test_threshold_and_minimum_steps(tmp_path, slow, n, named):
    rd = RunDir(tmp_path / "run")
    write_rank(rd, 0, "n1", 1.0, n)
    write_rank(rd, 1, "n2", slow, n)
    assert bool(score_run(rd.path).stragglers) is named


def test_one_slow_host_among_four_and_a_single_slow_rank_does_not_make_its_host_slow(tmp_path):
    rd = RunDir(tmp_path / "run")
    rank = 0
    for host in ("a", "b", "c", "d"):
        for local in range(3):
            c = 0.5
            if host == "c":
                c = 1.0  # the whole host is throttled
            if host == "b" and local == 0:
                c = 5.0  # one bad rank on b: its host's median stays 0.5
            write_rank(rd, rank, host, c, 20)
            rank += 1
    report = score_run(rd.path)
    assert [h.host for h in report.stragglers] == ["c"]
    assert next(h for h in report.hosts if h.host == "c").score == pytest.approx(2.0)


def test_only_the_newest_attempt_counts_and_hosts_come_from_its_pid_records(tmp_path):
    rd = two_hosts(tmp_path, slow=3.0, attempt=0)  # attempt 0 had a slow n2 ...
    for rank, host in [(0, "n1"), (1, "n1"), (2, "n3"), (3, "n3")]:  # ... attempt 1 replaced it with n3, healthy
        write_rank(rd, rank, host, 0.4, 15, attempt=1)
    report = score_run(rd.path)
    assert report.attempt == 1 and report.stragglers == []
    assert sorted(h.host for h in report.hosts) == ["n1", "n3"]
    assert score_run(rd.path, attempt=0).hosts == []  # attempt 1 rewrote every rank's heartbeat
    # a rank left over from a larger earlier attempt (rank 4, attempt 0) is not counted
    write_rank(rd, 4, "n9", 9.0, 50, attempt=0)
    assert score_run(rd.path).stragglers == []


def test_without_pid_records_the_heartbeat_names_the_host_and_unmeasured_ranks_are_listed(tmp_path):
    rd = RunDir(tmp_path / "run")
    write_rank(rd, 0, "n1", 0.3, 12, pid=False)
    write_rank(rd, 1, "n2", 0.9, 12, pid=False)
    write_rank(rd, 2, "n2", None, 0, pid=False)  # still loading: no compute time yet
    report = score_run(rd.path)
    assert [h.host for h in report.stragglers] == ["n2"] and report.unmeasured_ranks == [2]


def test_nothing_to_say_for_one_host_or_an_empty_run(tmp_path):
    rd = RunDir(tmp_path / "run")
    assert score_run(rd.path).hosts == [] and score_run(rd.path).lines() == []
    write_rank(rd, 0, "n1", 0.3, 12)
    write_rank(rd, 1, "n1", 3.0, 12)
    (only,) = score_run(rd.path).hosts
    assert only.reference_s is None and not only.straggler


def test_watch_announces_each_slow_host_once_per_attempt(tmp_path):
    rd = two_hosts(tmp_path, slow=2.0, n=5)
    watch = StragglerWatch()
    hosts = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
    assert watch.check(rd.heartbeats(), hosts, 0) == []  # 5 steps: too early to judge
    rd = two_hosts(tmp_path, slow=2.0, n=12)
    (line,) = watch.check(rd.heartbeats(), hosts, 0)
    assert line.startswith("ftkit: straggler: host n2 (ranks 2, 3): ")
    assert watch.check(rd.heartbeats(), hosts, 0) == []  # said once
    assert [h.host for h in watch.report.stragglers] == ["n2"]


def test_hosts_to_exclude_follows_min_nodes():
    beats = [
        {"rank": i, "attempt": 0, "node": h, "compute_ewma_s": c, "compute_n": 20}
        for i, (h, c) in enumerate([("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 3.0)])
    ]
    report = score(beats)
    assert {h.host for h in report.stragglers} == {"c", "d"}
    hosts = ["a", "b", "c", "d"]
    assert hosts_to_exclude(report, hosts, None) == []  # null: every node must stay
    assert hosts_to_exclude(report, hosts, 4) == []
    assert hosts_to_exclude(report, hosts, 3) == ["d"]  # the slowest first
    assert hosts_to_exclude(report, hosts, 2) == ["d", "c"]
    assert hosts_to_exclude(report, hosts, 1) == ["d", "c"]
