"""The timeline of a run as data: one row per host, a bar per attempt phase, a marker per decision (pure functions).

Time is *run time*: seconds since the run's first event with the gaps between launches (nothing ran) cut out, so
a run relaunched a day later still reads as one story; each launch after the first is marked where it begins.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ftkit.report.goodput import Attempt, Goodput, fmt_s, timed_events
from ftkit.rundir.records import Event

# phase bars and what they mean
PHASES = {
    "startup": "start-up (launch to first logged step)",
    "training": "training (first to last progress record)",
    "ending": "end of attempt (failure detection, or final save and teardown)",
    "backoff": "restart backoff",
}
# markers: event name -> legend label
MARKS = {
    "failure": "failure",
    "restart": "restart",
    "stop_requested": "graceful stop requested",
    "stopped": "stopped (committed)",
    "finished": "finished",
    "shrink": "continued on fewer hosts",
    "host_lost": "host lost",
    "straggler": "straggler named",
    "slurm": "Slurm start / requeue",
    "gave_up": "gave up",
    "interrupted": "interrupted",
    "launch_boundary": "ftkit launch again",
}


@dataclass(frozen=True)
class Bar:
    host: str
    attempt: int
    phase: str  # a key of PHASES
    start: float  # run time, seconds
    end: float


@dataclass(frozen=True)
class Mark:
    kind: str  # a key of MARKS
    time: float  # run time, seconds
    label: str
    hosts: tuple[str, ...] = ()  # () : every host of the attempt


@dataclass
class Timeline:
    hosts: list[str]
    bars: list[Bar] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    span_s: float = 0.0
    start_epoch: float | None = None  # wall-clock time of run time 0

    def rows(self) -> dict[str, int]:
        return {h: i for i, h in enumerate(self.hosts)}


class RunClock:
    """Epoch seconds -> run time (the gaps between launches removed)."""

    def __init__(self, g: Goodput):
        self.launches: list[tuple[float, float, float]] = []  # (epoch start, epoch end, run time at start)
        run = 0.0
        for start, end in g.spans:
            self.launches.append((start, end, run))
            run += max(0.0, end - start)

    def __call__(self, t: float) -> float:
        for start, end, base in reversed(self.launches):
            if t >= start:
                return base + min(t, end) - start
        return 0.0

    @property
    def start(self) -> float | None:
        return self.launches[0][0] if self.launches else None


def _short(e: Event) -> str:
    kind = e.get("kind") or ""
    meaning = str(e.get("exit_meaning") or "")
    if meaning:
        meaning = meaning.split(" (")[0]
    text = ", ".join(x for x in (str(kind), meaning) if x)
    step = e.get("step")
    return (f"{text} at step {step}" if step is not None else text) or "failure"


def build_timeline(events_in: Iterable[Event], g: Goodput) -> Timeline:
    """Rows, bars and markers for the run's attempts (the hosts each attempt ran on)."""
    events = timed_events(events_in)
    clock = RunClock(g)
    hosts: list[str] = []
    for a in g.attempts:
        for h, _ in a.hosts:
            if h not in hosts:
                hosts.append(h)
    tl = Timeline(hosts=hosts or ["localhost"], start_epoch=clock.start)
    for a in g.attempts:
        _attempt_bars(tl, a, clock)
    for i, (_, _, base) in enumerate(clock.launches[1:], start=2):
        tl.marks.append(Mark("launch_boundary", base, f"launch {i}"))
    for e in events:
        kind = e["event"]
        t = clock(float(e["time"]))
        if kind == "failure":
            tl.marks.append(Mark(kind, t, f"attempt {e.get('attempt')}: {_short(e)}"))
        elif kind == "restart":
            n = e.get("restarts")
            tl.marks.append(Mark(kind, t, f"restart{f' {n}' if n is not None else ''} after {e.get('delay_s') or 0} s"))
        elif kind == "stop_requested":
            tl.marks.append(Mark(kind, t, f"stop requested ({e.get('signal') or 'signal'})"))
        elif kind in ("stopped", "finished", "gave_up", "interrupted"):
            tl.marks.append(Mark(kind, t, str(e.get("message") or kind)[:120]))
        elif kind == "shrink":
            names = [str(h[0]) for h in e.get("hosts") or [] if isinstance(h, list) and h]
            size = f" (world size {e['world_size']})" if e.get("world_size") is not None else ""
            tl.marks.append(Mark(kind, t, f"continued on {', '.join(names) or 'fewer hosts'}{size}"))
        elif kind == "host_lost":
            lost = tuple(str(h) for h in e.get("hosts") or [])
            tl.marks.append(Mark(kind, t, f"lost {', '.join(lost)}", lost))
        elif kind == "straggler":
            report = e.get("report")
            slow = tuple(str(h) for h in ((report.get("stragglers") if report else None) or []))
            tl.marks.append(Mark(kind, t, str(e.get("message") or "straggler")[:120], slow))
        elif kind == "slurm":
            n = e.get("restart_count")
            tl.marks.append(Mark(kind, t, f"Slurm requeue {n}" if n else "Slurm job start"))
    tl.span_s = max([sum(end - start for start, end in g.spans)] + [b.end for b in tl.bars])
    tl.marks.sort(key=lambda m: m.time)
    return tl


def _attempt_bars(tl: Timeline, a: Attempt, clock: RunClock) -> None:
    first, progress = a.first_step_time, a.progress_end
    launch, end = clock(a.launch), clock(a.end)
    train0 = clock(min(max(first, a.launch), a.end)) if first is not None else end
    train1 = clock(min(max(progress, a.launch), a.end)) if progress is not None else train0
    phases = [("startup", launch, train0), ("training", train0, train1), ("ending", train1, end)]
    if a.restart is not None:
        r = float(a.restart["time"])
        delay = float(a.restart.get("delay_s") or 0.0)
        phases.append(("backoff", clock(r), clock(r) + delay))
    for host, _ in a.hosts:
        for phase, s, e in phases:
            if e > s:
                tl.bars.append(Bar(host, a.attempt, phase, s, e))


def describe(tl: Timeline) -> list[str]:
    """The marks as text lines (run time, label): the page's timeline table and a check for tests."""
    return [f"{fmt_s(m.time)}: {m.label}" for m in tl.marks]
