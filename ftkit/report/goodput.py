"""Where a run's wall-clock time went, from ``events.jsonl`` and ``metrics.jsonl`` alone (pure functions).

**Goodput** is productive training time over wall time:

* **wall time**: from the first to the last event of each ``ftkit launch`` of the run directory (events.jsonl
  times, the supervisor's clock), summed over launches. The time between one launch's end and the next launch
  (nothing ran) is reported apart, not counted. A launch that has not ended (a live run, or a supervisor that was
  killed) lasts until its newest event or metrics record.
* **productive time**: over every logged training step (metrics.jsonl, rank 0's clock) the interval from the
  previous logged step *of the same attempt*, counted only for the steps that were kept, less the checkpoint saves
  and evaluations measured inside it. A step is kept when no later attempt resumed from an earlier step (then it
  was recomputed, or lost). With ``logging_steps`` > 1 one interval covers several steps; when a later attempt
  resumed from a step inside it, the kept share is proportional to its steps. An attempt's first logged step has
  no previous one: its interval is part of the attempt's start-up.

Everything else is the loss of time, in these categories (they add up to the wall time): see :data:`CATEGORIES`.
A straggling host costs time *inside* the productive steps (every step waits for the slowest rank); it is
estimated apart from the per-host compute times the supervisor records (``step_times`` events), not subtracted.

Standard library only: ``ftkit status`` uses it.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import TypedDict

from ftkit.rundir.records import Event, MetricsRecord, as_int, as_number

# (key, label, what it is): the breakdown's categories in the order the page and the JSON show them
CATEGORIES: tuple[tuple[str, str, str], ...] = (
    (
        "productive",
        "productive training",
        "intervals between logged steps that were kept, less the saves and evaluations inside them",
    ),
    (
        "startup",
        "start-up",
        "from each attempt's launch to its first logged step (engine and process start, loading the model and data, "
        "loading the checkpoint, the first logged step), and choosing and verifying the checkpoint before it",
    ),
    (
        "recomputed",
        "recomputed steps",
        "intervals of steps that a later attempt computed again (it resumed from an earlier checkpoint), or lost",
    ),
    ("saves", "checkpoint saves", "from a step's log record (or its evaluation) to its commit record in metrics.jsonl"),
    ("evaluation", "evaluation", "from a step's log record to its eval_loss record"),
    (
        "detection",
        "failure detection / hang",
        "from a failed attempt's last progress record to the failure ftkit declared (a hang lasts hang_timeout_s); "
        "a start that never reached a step within startup_timeout_s, from its launch",
    ),
    (
        "teardown",
        "stop and teardown",
        "after training ended or failed: the final model's save, the engine's exit, teardown, lost-host probes",
    ),
    ("backoff", "restart backoff", "the delay before a restart (resilience.backoff_s, doubling, with jitter)"),
    ("other", "other", "what none of the above explains (e.g. an attempt still running since its newest record)"),
)
LABELS = {k: label for k, label, _ in CATEGORIES}
# a launch's last event: its supervisor's outcome, or (its supervisor gone) rank 0's record of how the ranks ended
ENDS = frozenset(
    {"finished", "stopped", "gave_up", "interrupted", "refused", "failed", "orphan_finished", "orphan_stopped"}
)
ATTEMPT_ENDS = ENDS | {"failure"}
# The events a launch opens with (ftkit.run.job: a takeover, the changes since the checkpoint, the preflight), before
# anything else: one of them after any other event is the next launch, also when the one before has no outcome
# (its supervisor was SIGKILLed along with its ranks and wrote nothing more).
OPENS = frozenset({"takeover", "resume_changes", "preflight"})
_CKPT_STEP = re.compile(r"checkpoint-(\d+)$")


# ------------------------------------------------------------------------------------------------ records


@dataclass(frozen=True, slots=True)  # one per logged step: a long run has millions
class Logged:
    """One metrics.jsonl training record (rank 0 writes one per logged step)."""

    attempt: int
    step: int
    time: float
    loss: float
    tokens_seen: float | None = None
    grad_norm: float | None = None
    lr: float | None = None


@dataclass(frozen=True, slots=True)  # one per logged step: a long run has millions
class Eval:
    attempt: int
    step: int
    time: float
    loss: float


@dataclass(frozen=True, slots=True)  # one per logged step: a long run has millions
class Commit:
    """A ``commit`` record: rank 0 committed ``checkpoint-STEP`` (``commit_s``: ftkit's barrier and record)."""

    attempt: int
    step: int
    time: float
    commit_s: float | None
    stop: bool = False
    tier: str = "durable"  # local: a node-local tier's commit (ftkit.launch.tier); durable: the run directory's


@dataclass
class Metrics:
    steps: list[Logged] = field(default_factory=list)
    evals: list[Eval] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    copied: set[int] = field(default_factory=set)  # steps the checkpoint agents published in the run directory
    rotated: set[int] = field(default_factory=set)  # steps a commit's rotation deleted (in the tier it saved to)


def parse_metrics(rows: Iterable[MetricsRecord]) -> Metrics:
    """The records goodput needs; lines without a numeric step, attempt and time are left out."""
    out = Metrics()
    for m in rows:
        step, attempt, t = as_int(m.get("step")), as_int(m.get("attempt", 0)), as_number(m.get("time"))
        if step is None or attempt is None or t is None:
            continue
        if m.get("event") == "commit":
            for p in m.get("rotated") or []:
                if isinstance(p, str) and (k := _CKPT_STEP.search(p)):
                    out.rotated.add(int(k.group(1)))
            tier = "local" if m.get("tier") == "local" else "durable"
            commit_s = as_number(m.get("commit_s"))
            out.commits.append(Commit(attempt, step, t, commit_s, bool(m.get("stop")), tier))
        elif m.get("event") == "durable" and m.get("published"):
            out.copied.add(step)
        elif "loss" in m and (loss := as_number(m.get("loss"))) is not None:
            out.steps.append(
                Logged(
                    attempt,
                    step,
                    t,
                    loss,
                    as_number(m.get("tokens_seen")),
                    as_number(m.get("grad_norm")),
                    as_number(m.get("lr")),
                )
            )
        elif "eval_loss" in m and (loss := as_number(m.get("eval_loss"))) is not None:
            out.evals.append(Eval(attempt, step, t, loss))
    return out


def timed_events(events: Iterable[Event]) -> list[Event]:
    """Events with a numeric time, in file order (the supervisor appends them in the order it decides)."""
    return [e.copy() for e in events if as_number(e.get("time")) is not None and isinstance(e.get("event"), str)]


def sessions(events: list[Event]) -> list[list[Event]]:
    """The events of each ``ftkit launch``: a launch ends with its outcome (:data:`ENDS`), or where the next one
    opens (:data:`OPENS`) when it has none."""
    out: list[list[Event]] = []
    cur: list[Event] = []
    for e in events:
        if e["event"] in OPENS and any(x["event"] not in OPENS for x in cur):
            out.append(cur)
            cur = []
        cur.append(e)
        if e["event"] in ENDS:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def _session_ends(sess: list[list[Event]], metrics: Metrics) -> list[float]:
    """When each launch ended: its outcome's time; one without an outcome (live, or its supervisor killed) lasts
    until its newest event or progress record of its own attempts, never into the next launch."""
    out = []
    for i, s in enumerate(sess):
        start, end = float(s[0]["time"]), float(s[-1]["time"])
        if s[-1]["event"] not in ENDS:
            mine = {_attempt_of(e) for e in s if e["event"] == "launch"}
            nxt = float(sess[i + 1][0]["time"]) if i + 1 < len(sess) else math.inf
            for records in (metrics.steps, metrics.evals, metrics.commits):
                newest = max((r.time for r in records if r.attempt in mine and start <= r.time <= nxt), default=end)
                end = max(end, newest)
        out.append(end)
    return out


# ------------------------------------------------------------------------------------------------ attempts


@dataclass
class Attempt:
    """One attempt's story, on the supervisor's clock (events) and rank 0's (metrics)."""

    attempt: int
    launch: float
    end: float  # its end event, or the end of its launch when it has none (still running, or killed)
    end_event: Event | None  # failure / stopped / finished / ... (None: still running or unknown)
    resume_step: int  # 0: fresh start
    steps: list[Logged] = field(default_factory=list)
    evals: list[Eval] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    kept_until: float = math.inf  # steps after this were recomputed (or lost): the lowest later resume step
    restart: Event | None = None  # the restart event after it
    next_launch: float | None = None
    hosts: list[tuple[str, int]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # the events between its launch and the next one
    killed: bool = False  # its launch ended with no outcome and a later launch followed (its supervisor was killed)
    # filled by account(): seconds by category, and the measured throughput
    seconds: dict[str, float] = field(default_factory=dict)
    work_s: float = 0.0  # step intervals less saves/evaluations (kept and recomputed)
    work_steps: float = 0.0  # the steps those intervals cover
    work_tokens: float | None = 0.0  # tokens_seen over those intervals; None when a record has none
    intervals: list[tuple[int, float]] = field(default_factory=list)  # (steps covered, seconds) clean intervals

    @property
    def first_step_time(self) -> float | None:
        return self.steps[0].time if self.steps else None

    @property
    def progress_end(self) -> float | None:
        """The newest progress record of the attempt (a step, an evaluation, a commit; each list is in time
        order)."""
        times = [x[-1].time for x in (self.steps, self.evals, self.commits) if x]
        return max(times) if times else None

    @property
    def outcome(self) -> str:
        e = self.end_event
        if e is None:
            return "no outcome (its ftkit launch was killed)" if self.killed else "running"
        if e["event"] == "failure":
            return f"failed ({e.get('kind') or 'failure'})"
        return str(e["event"])

    @property
    def step_time_s(self) -> float | None:
        """Measured seconds per optimizer step (step intervals without saves or evaluations in them)."""
        return self.work_s / self.work_steps if self.work_steps > 0 else None

    @property
    def median_step_s(self) -> float | None:
        per = [s / n for n, s in self.intervals if n > 0]
        return statistics.median(per) if per else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.work_tokens / self.work_s if self.work_tokens and self.work_s > 0 else None

    @property
    def kept_steps(self) -> int:
        return sum(1 for s in self.steps if s.step <= self.kept_until)

    @property
    def recomputed_steps(self) -> int:
        return len(self.steps) - self.kept_steps


def _attempt_of(e: Event) -> int | None:
    return as_int(e.get("attempt"))


def attempts(events: list[Event], metrics: Metrics) -> list[Attempt]:
    """Every attempt with a ``launch`` event, oldest first, with its records and the events that followed it."""
    out: list[Attempt] = []
    hosts: list[tuple[str, int]] = []  # the plan's, then each shrink's
    every = sessions(events)
    for k, (sess, sess_end) in enumerate(zip(every, _session_ends(every, metrics), strict=True)):
        killed = k + 1 < len(every) and sess[-1]["event"] not in ENDS
        launches = [i for i, e in enumerate(sess) if e["event"] == "launch" and _attempt_of(e) is not None]
        for n, i in enumerate(launches):
            for e in sess[launches[n - 1] if n else 0 : i]:
                if e["event"] in ("plan", "shrink") and isinstance(e.get("hosts"), list):
                    hosts = [(str(h[0]), int(h[1])) for h in e["hosts"] if isinstance(h, list) and len(h) == 2]
            e = sess[i]
            upto = launches[n + 1] if n + 1 < len(launches) else len(sess)
            after = sess[i + 1 : upto]
            end_ev = next((x for x in after if x["event"] in ATTEMPT_ENDS), None)
            # a failure ends the attempt when ftkit declares it; otherwise its teardown does (a graceful stop, a
            # finished run, leaving stragglers out): the outcome event follows the teardown
            ends = [x for x in after if x["event"] in ATTEMPT_ENDS or x["event"] == "teardown"]
            end = float(ends[0]["time"]) if ends else sess_end
            spawned = [(str(x.get("host")), 0) for x in after if x["event"] == "spawn"]
            out.append(
                Attempt(
                    attempt=_attempt_of(e) or 0,
                    launch=float(e["time"]),
                    end=max(end, float(e["time"])),
                    end_event=end_ev,
                    resume_step=_resume_step(sess[:i], _attempt_of(e) or 0),
                    restart=next((x for x in after if x["event"] == "restart"), None),
                    next_launch=float(sess[upto]["time"]) if upto < len(sess) else None,
                    hosts=list(hosts) or spawned or [("localhost", 0)],
                    events=[e, *after],
                    killed=killed and n + 1 == len(launches),
                )
            )
    by_attempt = {a.attempt: a for a in out}
    for s in metrics.steps:
        if s.attempt in by_attempt:
            by_attempt[s.attempt].steps.append(s)
    for ev in metrics.evals:
        if ev.attempt in by_attempt:
            by_attempt[ev.attempt].evals.append(ev)
    for c in metrics.commits:
        if c.attempt in by_attempt:
            by_attempt[c.attempt].commits.append(c)
    for a in out:
        a.steps.sort(key=lambda s: (s.time, s.step))
        a.evals.sort(key=lambda s: s.time)
        a.commits.sort(key=lambda s: s.time)
    later = math.inf
    for a in sorted(out, key=lambda x: x.attempt, reverse=True):
        a.kept_until = later
        first = a.resume_step if a.resume_step >= 0 else (min((s.step for s in a.steps), default=1) - 1)
        later = min(later, first)
    return sorted(out, key=lambda x: x.launch)


def _resume_step(before: list[Event], attempt: int) -> int:
    """The step an attempt resumed from (0 fresh), from the checkpoint_chosen/fresh_start before its launch;
    -1 when not recorded (then the step before its first logged one is taken)."""
    for e in reversed(before):
        if _attempt_of(e) != attempt:
            continue
        if e["event"] == "fresh_start":
            return 0
        if e["event"] == "checkpoint_chosen":
            step = as_int(e.get("step"))
            return step if step is not None else -1
    return -1


# ------------------------------------------------------------------------------------------------ accounting


class _Spans:
    """Time spans (saves, evaluations) and how much of an interval they cover: O(log n) per interval, where a sum
    over every span made a run with a save per step quadratic (a 10,000-step report took two minutes)."""

    def __init__(self, spans: list[tuple[float, float]]):
        self.spans = sorted(spans)
        self.starts = [s0 for s0, _ in self.spans]
        self.longest = max((s1 - s0 for s0, s1 in self.spans), default=0.0)

    def overlap(self, a0: float, a1: float) -> float:
        total = 0.0
        i = bisect.bisect_left(self.starts, a1)  # spans from here on start at or after the interval's end
        while i > 0:
            i -= 1
            s0, s1 = self.spans[i]
            if s0 + self.longest <= a0:  # this one and every earlier one ends before the interval starts
                break
            total += max(0.0, min(a1, s1) - max(a0, s0))
        return total


def save_spans(a: Attempt, only: Container[int] | None = None) -> list[tuple[Commit, float, float]]:
    """(commit, start, end) of each save of the attempt (``only``: of these steps). HF Trainer logs a step, then
    evaluates, then saves (ftkit commits in on_save), so a save runs from the step's log record (or its
    evaluation's) to its commit record; a save at a step that was not logged is measured by the commit alone
    (``commit_s``)."""
    commits = a.commits if only is None else [c for c in a.commits if c.step in only]
    wanted = {c.step for c in commits}
    logged = {s.step: s.time for s in a.steps if s.step in wanted}
    evaluated = {e.step: e.time for e in a.evals if e.step in wanted}
    out = []
    for c in commits:
        starts = [t for t in (logged.get(c.step), evaluated.get(c.step)) if t is not None and t <= c.time]
        start = max(starts) if starts else c.time - (c.commit_s or 0.0)
        out.append((c, max(start, a.launch), c.time))
    return out


def _overhead_spans(a: Attempt) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(save spans, evaluation spans) inside the attempt; an evaluation runs from its step's log record to its
    eval_loss record (one at a step that was not logged stays in the step interval)."""
    logged = {s.step: s.time for s in a.steps}
    evals = [(logged[e.step], e.time) for e in a.evals if e.step in logged and logged[e.step] <= e.time]
    return [(s0, s1) for _, s0, s1 in save_spans(a)], evals


def account(a: Attempt) -> dict[str, float]:
    """Seconds of the attempt from its launch to its end event by category (start-up, productive, recomputed,
    saves, evaluation, detection, teardown, other); fills the attempt's throughput fields."""
    sec = dict.fromkeys(LABELS, 0.0)

    def clamp(t: float) -> float:  # rank 0's clock against the supervisor's: inside the attempt
        return min(max(t, a.launch), a.end)

    first = a.first_step_time
    failed = a.end_event is not None and a.end_event["event"] == "failure"
    if first is None:  # never reached a logged step: a start that hung, or one that failed (or still starting)
        hung = failed and a.end_event is not None and a.end_event.get("kind") in ("startup", "hang")
        sec["detection" if hung else "startup"] += a.end - a.launch
        a.seconds = sec
        return sec
    first = clamp(first)
    sec["startup"] += first - a.launch
    saves, evals = _overhead_spans(a)
    saves = [(clamp(s0), clamp(s1)) for s0, s1 in saves]
    evals = [(clamp(s0), clamp(s1)) for s0, s1 in evals]
    spans = saves + evals
    covering = _Spans(spans)
    a.work_s, a.work_steps, a.intervals = 0.0, 0.0, []
    tokens: float | None = 0.0
    last = a.steps[0]
    covered = 0.0  # of the overhead spans, what lies inside step intervals
    for s in a.steps[1:]:
        t0, t1 = clamp(last.time), clamp(s.time)
        n = s.step - last.step
        if t1 <= t0 or n <= 0:
            last = s
            continue
        inside = covering.overlap(t0, t1)
        covered += inside
        net = max(0.0, (t1 - t0) - inside)
        kept = 1.0 if s.step <= a.kept_until else max(0.0, min(1.0, (a.kept_until - last.step) / n))
        sec["productive"] += net * kept
        sec["recomputed"] += net * (1 - kept)
        a.work_s += net
        a.work_steps += n
        if inside == 0:
            a.intervals.append((n, net))
        if tokens is not None:
            tokens = (
                None if s.tokens_seen is None or last.tokens_seen is None else tokens + s.tokens_seen - last.tokens_seen
            )
        last = s
    a.work_tokens = tokens
    sec["saves"] += sum(s1 - s0 for s0, s1 in saves)
    sec["evaluation"] += sum(s1 - s0 for s0, s1 in evals)
    last_log = clamp(a.steps[-1].time)
    outside = sum(s1 - s0 for s0, s1 in spans) - covered  # overhead after the last logged step (a stop's save)
    progress = clamp(a.progress_end or last_log)
    sec["other"] += max(0.0, (progress - last_log) - outside)
    sec["detection" if failed else ("teardown" if a.end_event is not None else "other")] += a.end - progress
    a.seconds = sec
    return sec


class LargestLoss(TypedDict):
    category: str  # a key of CATEGORIES other than productive
    seconds: float


class GoodputDict(TypedDict):
    """:meth:`Goodput.as_dict`: what ``ftkit status --json`` shows of the goodput."""

    ratio: float | None
    productive_s: float
    wall_s: float
    largest_loss: LargestLoss | None
    breakdown_s: dict[str, float]
    between_launches_s: float
    straggler_wait_s: float | None
    launches: int
    live: bool
    definition: str
    line: str


@dataclass
class Goodput:
    """Productive time over wall time, and where the rest went (seconds by category; they add up to wall_s)."""

    wall_s: float
    breakdown: dict[str, float]
    idle_s: float = 0.0  # between launches: not running, not in wall_s
    spans: list[tuple[float, float]] = field(default_factory=list)  # each launch's (first, last) epoch time
    live: bool = False  # the newest launch has no outcome yet (running, or its supervisor was killed)
    straggler_s: float | None = None  # estimated wait for the slowest host, inside productive time
    attempts: list[Attempt] = field(default_factory=list, repr=False)
    copied: set[int] = field(default_factory=set, repr=False)  # steps the agents made durable (local tier)
    rotated: set[int] = field(default_factory=set, repr=False)  # steps deleted by rotation

    @property
    def launches(self) -> int:
        return len(self.spans)

    @property
    def productive_s(self) -> float:
        return self.breakdown.get("productive", 0.0)

    @property
    def ratio(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    @property
    def largest_loss(self) -> tuple[str, float] | None:
        losses = [(k, v) for k, v in self.breakdown.items() if k != "productive" and v > 0]
        return max(losses, key=lambda kv: kv[1]) if losses else None

    def line(self) -> str:
        """``ftkit status``'s goodput line."""
        if self.ratio is None:
            return "goodput: n/a (no time recorded yet)"
        text = f"goodput: {self.ratio:.1%} (productive training {fmt_s(self.productive_s)} of {fmt_s(self.wall_s)} wall"
        big = self.largest_loss
        if big is not None:
            text += f"; largest loss: {LABELS[big[0]]} {fmt_s(big[1])}"
        return text + ")" + (" so far" if self.live else "")

    def as_dict(self) -> GoodputDict:
        big = self.largest_loss
        return {
            "ratio": round(self.ratio, 6) if self.ratio is not None else None,
            "productive_s": round(self.productive_s, 3),
            "wall_s": round(self.wall_s, 3),
            "largest_loss": {"category": big[0], "seconds": round(big[1], 3)} if big else None,
            "breakdown_s": {k: round(v, 3) for k, v in self.breakdown.items()},
            "between_launches_s": round(self.idle_s, 3),
            "straggler_wait_s": round(self.straggler_s, 3) if self.straggler_s is not None else None,
            "launches": self.launches,
            "live": self.live,
            "definition": DEFINITION,
            "line": self.line(),
        }


DEFINITION = (
    "productive training time / wall time. Wall: first to last event of each ftkit launch (events.jsonl), summed; "
    "productive: over the logged steps that were kept (no later attempt resumed from an earlier step), the interval "
    "from the previous logged step of the same attempt (metrics.jsonl), less the saves and evaluations inside it"
)


def goodput(events: Iterable[Event], metrics: Iterable[MetricsRecord]) -> Goodput:
    """Goodput of a run from its parsed events.jsonl and metrics.jsonl records (any order of files; live or not)."""
    evs = timed_events(events)
    m = parse_metrics(metrics)
    sess = sessions(evs)
    if not sess:
        return Goodput(0.0, dict.fromkeys(LABELS, 0.0))
    atts = attempts(evs, m)
    breakdown = dict.fromkeys(LABELS, 0.0)
    wall = idle = 0.0
    prev_end: float | None = None
    spans = []
    for s, end in zip(sess, _session_ends(sess, m), strict=True):
        start = float(s[0]["time"])
        spans.append((start, end))
        wall += end - start
        if prev_end is not None:
            idle += max(0.0, start - prev_end)
        prev_end = end
        mine = [a for a in atts if start <= a.launch <= end]
        cursor = start
        for a in mine:
            gap = max(0.0, a.launch - cursor)
            prev = next((p for p in mine if p.next_launch == a.launch), None)
            restart = prev.restart if prev is not None else None
            if restart is not None and cursor <= float(restart["time"]) <= a.launch:
                r = float(restart["time"])
                delay = min(max(as_number(restart.get("delay_s")) or 0.0, 0.0), a.launch - r)
                breakdown["teardown"] += r - cursor
                breakdown["backoff"] += delay
                breakdown["startup"] += a.launch - r - delay  # choosing and verifying the checkpoint
            elif prev is None:
                breakdown["startup"] += gap  # the launch's own start: choosing the checkpoint
            else:
                breakdown["other"] += gap
            for k, v in account(a).items():
                breakdown[k] += v
            cursor = max(cursor, a.end)
        tail = max(0.0, end - cursor)
        breakdown["teardown" if s[-1]["event"] in ENDS and mine else "other"] += tail
    live = bool(sess[-1]) and sess[-1][-1]["event"] not in ENDS
    return Goodput(
        wall_s=wall,
        breakdown=breakdown,
        idle_s=idle,
        spans=spans,
        live=live,
        straggler_s=straggler_wait(evs, atts),
        attempts=atts,
        copied=m.copied,
        rotated=m.rotated,
    )


def straggler_wait(events: list[Event], atts: list[Attempt]) -> float | None:
    """Seconds the kept steps spent waiting for the slowest host, estimated from the per-host compute times the
    supervisor recorded at the end of each attempt (``step_times`` events): (slowest - median) x kept steps. None
    without such a record or with a single host."""
    total, seen = 0.0, False
    for a in atts:
        rec = next((e for e in a.events if e["event"] == "step_times"), None)
        hosts = [h for h in (rec or {}).get("hosts") or [] if isinstance(h, dict) and as_number(h.get("compute_s"))]
        if len(hosts) < 2:
            continue
        seen = True
        times = [float(h["compute_s"]) for h in hosts]
        total += (max(times) - statistics.median(times)) * a.kept_steps
    return total if seen else None


def fmt_s(seconds: float) -> str:
    """1.23 s, 45.6 s, 12 min 3 s, 2 h 05 min."""
    if seconds < 100:
        return f"{seconds:.3g} s" if seconds < 10 else f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
