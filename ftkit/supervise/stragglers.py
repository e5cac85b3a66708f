"""Stragglers: a host whose ranks compute each step consistently slower than the other hosts' ranks.

In synchronous data-parallel training every optimizer step waits for the slowest rank, so one slow host (thermal
throttling, a noisy neighbour, a degraded GPU, another job on the node) sets the pace of the whole job. Each rank
times its own compute per step on its own clock (the model's forward passes, which hold no collective under DDP and
ZeRO-1/2; see :mod:`ftkit.hf`) and publishes an exponentially weighted average in its heartbeat
(``compute_ewma_s``, with ``compute_n``, the steps measured). Time spent waiting for peers is not in it, so a slow
host does not make the fast ones look slow (the lock-step step time would: every rank waits for the slowest).

The score, per host: the median of its ranks' ``compute_ewma_s``, divided by the median of the *other* hosts'
medians. A host is named a straggler when its score is at least :data:`SLOW_FACTOR` (1.5) and each of its ranks
has measured at least :data:`MIN_STEPS` (10) steps. Leaving the host itself out of the reference matters for
small jobs: with two hosts, one 2x slower than the other, "median of all hosts" is their mean and the slow host
would score only 1.33; against the other host it scores 2.0. The EWMA (weight 0.2 per step, :data:`ftkit.hf`'s
``COMPUTE_EWMA``) is what makes it *consistent*: a single slow step (a checkpoint save, a GC pause) moves it by a
fifth, a host slow for ten steps in a row moves it most of the way.

Hosts come from the ranks' pid records of the heartbeat's attempt (``"host"``, the hostfile name, which stays
distinct where several hosts share one hostname, as network namespaces do), else from the heartbeat itself.

Used by ``ftkit status`` (:func:`score_run`), by the supervisor's poll for the live output
(:class:`StragglerWatch`, fed the heartbeats the poll has read anyway), and for ``resilience.exclude_stragglers``
(:func:`hosts_to_exclude`). Import-light: the standard library only.
"""

from __future__ import annotations

import bisect
import os
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ftkit.rundir.layout import RunDir
from ftkit.rundir.records import EventSink, RankStepTimes, StragglerRecord, as_number

if TYPE_CHECKING:
    from ftkit.rundir.records import Heartbeat

SLOW_FACTOR = 1.5  # a host this many times slower than the other hosts' median is a straggler
MIN_STEPS = 10  # steps every rank of a host must have measured before it is judged


@dataclass(frozen=True)
class HostScore:
    host: str
    ranks: tuple[int, ...]
    compute_s: float  # median over the host's ranks of their compute_ewma_s
    reference_s: float | None  # median of the other hosts' compute_s; None with no other host to compare with
    steps: int  # the fewest steps any of its ranks has measured
    slow_factor: float = SLOW_FACTOR

    @property
    def score(self) -> float | None:
        return self.compute_s / self.reference_s if self.reference_s else None

    @property
    def judged(self) -> bool:
        return self.steps >= MIN_STEPS and self.score is not None

    @property
    def straggler(self) -> bool:
        return self.judged and self.score is not None and self.score >= self.slow_factor

    def describe(self) -> str:
        ranks = ", ".join(str(r) for r in self.ranks)
        return (
            f"host {self.host} (rank{'s' if len(self.ranks) > 1 else ''} {ranks}): "
            f"{self.compute_s:.3g} s compute per step, {self.score:.2f}x the other hosts' median "
            f"{self.reference_s:.3g} s, over {self.steps} steps"
        )


@dataclass
class StragglerReport:
    attempt: int | None
    hosts: list[HostScore] = field(default_factory=list)
    unmeasured_ranks: list[int] = field(default_factory=list)  # heartbeats without a compute time yet

    @property
    def stragglers(self) -> list[HostScore]:
        return [h for h in self.hosts if h.straggler]

    def lines(self) -> list[str]:
        """One line per straggler (``straggler: host n2 (ranks 2, 3): ...``); nothing when there is none."""
        return [
            f"straggler: {h.describe()} (threshold {h.slow_factor}x after {MIN_STEPS} steps)" for h in self.stragglers
        ]

    def as_dict(self) -> StragglerRecord:
        return {
            "attempt": self.attempt,
            "threshold": SLOW_FACTOR,
            "min_steps": MIN_STEPS,
            "hosts": [
                {
                    "host": h.host,
                    "ranks": list(h.ranks),
                    "compute_s": h.compute_s,
                    "reference_s": h.reference_s,
                    "score": h.score,
                    "steps": h.steps,
                    "straggler": h.straggler,
                }
                for h in self.hosts
            ],
            "stragglers": [h.host for h in self.stragglers],
        }


def _positive(x: object) -> float | None:
    n = as_number(x)
    return n if n is not None and n > 0 else None


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def score(
    heartbeats: Iterable[Heartbeat],
    hosts_by_rank: dict[int, str] | None = None,
    *,
    attempt: int | None = None,
    slow_factor: float = SLOW_FACTOR,
) -> StragglerReport:
    """Score hosts from rank heartbeats (as :meth:`RunDir.heartbeats` returns them). ``attempt``: only that
    attempt's heartbeats (default: the newest attempt seen); ``hosts_by_rank``: rank -> host (pid records)."""
    tagged = [
        (_int(b.get("attempt")), b) for b in heartbeats if isinstance(b, dict) and _int(b.get("rank")) is not None
    ]
    if attempt is None:
        attempt = max((a for a, _ in tagged if a is not None), default=None)
    beats = [b for a, b in tagged if a == attempt] if attempt is not None else [b for _, b in tagged]
    per_host: dict[str, list[tuple[int, float, int]]] = {}
    unmeasured = []
    by_rank = hosts_by_rank or {}
    for b in beats:
        rank = b["rank"]
        c, n = _positive(b.get("compute_ewma_s")), _int(b.get("compute_n")) or 0
        host = by_rank.get(rank) or b.get("node") or b.get("host")
        if c is None or not host:
            unmeasured.append(rank)
            continue
        per_host.setdefault(str(host), []).append((rank, c, n))
    medians = {h: statistics.median(c for _, c, _ in rs) for h, rs in per_host.items()}
    ordered = sorted(medians.values())
    hosts = []
    for h, rs in sorted(per_host.items()):
        hosts.append(
            HostScore(
                host=h,
                ranks=tuple(sorted(r for r, _, _ in rs)),
                compute_s=medians[h],
                reference_s=_median_without(ordered, medians[h]),
                steps=min(n for _, _, n in rs),
                slow_factor=slow_factor,
            )
        )
    return StragglerReport(attempt=attempt, hosts=hosts, unmeasured_ranks=sorted(unmeasured))


def _median_without(ordered: list[float], value: float) -> float | None:
    """The median of sorted ``ordered`` with one occurrence of ``value`` left out, in O(log n) (a poll at 1,024
    ranks on 128 hosts scores every host against the others without sorting 128 lists)."""
    n = len(ordered) - 1
    if n <= 0:
        return None
    i = bisect.bisect_left(ordered, value)

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def hosts_by_rank(rd: RunDir, attempt: int) -> dict[int, str]:
    """rank -> host (the hostfile name) from the attempt's pid records."""
    out = {}
    for rec in rd.records("pids", attempt):
        rank, host = _int(rec.get("rank")), rec.get("host")
        if rank is not None and isinstance(host, str) and host:
            out[rank] = host
    return out


def score_run(run_dir: str | os.PathLike[str], attempt: int | None = None) -> StragglerReport:
    """The straggler report of a run directory's newest attempt (or ``attempt``), from files alone."""
    rd = RunDir(run_dir)
    beats = rd.heartbeats()
    report = score(beats, attempt=attempt)
    if report.attempt is None:
        return report
    return score(beats, hosts_by_rank(rd, report.attempt), attempt=report.attempt)


def hosts_to_exclude(report: StragglerReport, hosts: list[str], min_nodes: int | None) -> list[str]:
    """The stragglers a restart may leave out under ``resilience.exclude_stragglers``: all of them when the hosts
    left still number ``cluster.min_nodes`` (null: every node must stay, so none), the slowest first otherwise
    as many as allowed; never every host."""
    if min_nodes is None:
        return []
    slow = sorted((h for h in report.stragglers if h.host in hosts), key=lambda h: -(h.score or 0))
    room = max(len(hosts) - max(min_nodes, 1), 0)
    return [h.host for h in slow[:room]]


class StragglerWatch:
    """For the supervisor's poll: feed it the heartbeats it read; it says each newly slow host once per attempt.

    ``check(heartbeats, hosts_by_rank, attempt)`` returns the lines to print now (empty most of the time); the
    latest report is kept in ``report`` for ``resilience.exclude_stragglers``."""

    def __init__(self, slow_factor: float = SLOW_FACTOR):
        self.slow_factor = slow_factor
        self.report: StragglerReport | None = None
        self._announced: set[tuple[int | None, str]] = set()

    def check(self, heartbeats: Iterable[Heartbeat], hosts: dict[int, str] | None, attempt: int | None) -> list[str]:
        self.report = score(heartbeats, hosts, attempt=attempt, slow_factor=self.slow_factor)
        out = []
        for h in self.report.stragglers:
            key = (self.report.attempt, h.host)
            if key not in self._announced:
                self._announced.add(key)
                out.append(f"ftkit: straggler: {h.describe()}")
        return out


def record_step_times(rd: RunDir, attempt: int, events: EventSink) -> None:
    """One ``step_times`` event: each rank's compute time per step (its heartbeat's EWMA of the forward passes) and
    each host's median, as :mod:`ftkit.supervise.stragglers` scores them. Nothing when no rank measured a step."""
    try:
        beats = [b for b in rd.heartbeats() if b.get("attempt") == attempt]
        report = score(beats, hosts_by_rank(rd, attempt), attempt=attempt)
    except OSError:
        return
    if not report.hosts:
        return
    by_rank = hosts_by_rank(rd, attempt)
    ranks = [
        RankStepTimes(
            rank=(rank := b.get("rank")),
            host=(by_rank.get(rank) if rank is not None else None) or b.get("node") or b.get("host"),
            compute_s=b.get("compute_ewma_s"),
            steps=b.get("compute_n"),
        )
        for b in sorted(beats, key=lambda b: b.get("rank") or 0)
        if isinstance(b.get("compute_ewma_s"), (int, float))
    ]
    events("step_times", None, hosts=report.as_dict()["hosts"], ranks=ranks)
