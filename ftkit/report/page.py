"""The report page: one self-contained HTML file (inline CSS and SVG, no script, no request of any kind).

:func:`write_report` is ``ftkit report``: it reads ``events.jsonl`` and ``metrics.jsonl`` (every number), the
checkpoint directories' commit records (their sizes-only verification state), and writes the page atomically.
"""

from __future__ import annotations

import errno
import heapq
import html
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

from ftkit.checkpoint.directory import list_checkpoints, list_set_aside
from ftkit.checkpoint.verify import verify
from ftkit.errors import NoSpace, Problem, UserError
from ftkit.report import charts
from ftkit.report.charts import CATEGORY_COLOURS
from ftkit.report.goodput import (
    CATEGORIES,
    DEFINITION,
    ENDS,
    Attempt,
    Goodput,
    fmt_s,
    goodput,
    save_spans,
    timed_events,
)
from ftkit.report.timeline import PHASES, Timeline, build_timeline
from ftkit.rundir.layout import RunDir, atomic_write, iter_metrics, read_events
from ftkit.rundir.outputs import check_output_file, starts_with
from ftkit.rundir.records import CommitRecord, Event, HostStepTimes

if TYPE_CHECKING:
    from ftkit.report.live import PlanRecord

TIER = "durable"  # a checkpoint the ranks saved in the run directory (shared storage)
MAX_CHECKPOINT_ROWS = 100  # rows of the checkpoint table (what is on disk always; then the newest saves)
CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:1.5em auto;
  max-width:1040px;padding:0 1em;color:#111;background:#fff}
h1{font-size:1.45em;margin-bottom:.2em} h2{font-size:1.12em;border-bottom:1px solid #bbb;padding-bottom:.15em;
  margin-top:1.7em}
table{border-collapse:collapse;width:100%;font-size:13px;margin:.4em 0}
th,td{border-bottom:1px solid #ddd;padding:.22em .5em;text-align:left;vertical-align:top}
th{font-weight:600;border-bottom:1px solid #999} td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;gap:.8em;flex-wrap:wrap;margin:.8em 0}
.card{border:1px solid #bbb;border-radius:4px;padding:.4em .9em;min-width:9em}
.card b{display:block;font-size:1.35em} .card span{color:#444;font-size:12px}
svg.chart{width:100%;height:auto;display:block} figure{margin:.5em 0}
figcaption,.note{color:#444;font-size:12px} .bad{color:#b00000;font-weight:600} .ok{color:#006b3c}
code{font-size:12px} .sw{vertical-align:middle}
@media print{body{margin:0;max-width:none;font-size:11px} h2{break-after:avoid}
  figure,table,.cards{break-inside:avoid} a{color:inherit;text-decoration:none}}
"""
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
MAX_ROWS = 2000  # decisions listed (a run with more says so)


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _table(head: list[str], rows: Iterable[Sequence[object]], num: Iterable[int] = (), cls: str = "") -> str:
    num = set(num)
    th = "".join(f"<th{' class=n' if i in num else ''}>{_e(h)}</th>" for i, h in enumerate(head))
    body = []
    for row in rows:
        tds = "".join(
            f"<td{' class=n' if i in num else ''}>{c if isinstance(c, _Html) else _e(c)}</td>"
            for i, c in enumerate(row)
        )
        body.append(f"<tr>{tds}</tr>")
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{"".join(body)}</tbody></table>'


class _Html(str):
    """Markup that a table cell puts in as it is (everything else is escaped)."""


def _swatch(colour: str) -> _Html:
    rect = f'<rect width="11" height="11" fill="{colour}"/>'
    return _Html(f'<svg class="sw" width="11" height="11" aria-hidden="true">{rect}</svg>')


def _clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t)) if t is not None else "-"


def _num(x: object, fmt: str = "{:.3g}", missing: str = "-") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else missing


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# ------------------------------------------------------------------------------------------------ data


class ThroughputRow(TypedDict):
    """One attempt's line of the throughput table (:func:`throughput_rows`)."""

    attempt: int
    world: int | None
    hosts: list[str]
    resume_step: int
    outcome: str
    startup_s: float | None
    kept: int
    recomputed: int
    step_s: float | None
    median_step_s: float | None
    tokens_per_s: float | None
    tokens_padded: bool  # tokens_per_s is an upper bound from the batch shape
    tflops: float | None
    mfu: float | None
    mfu_why: str  # why mfu is None ("" when it is not)


class CheckpointRow(TypedDict, total=False):
    """One line of the checkpoint table (:func:`checkpoint_rows`): a save (from its commit records), what is on
    disk, or both."""

    name: str
    step: int | None
    tier: str
    attempt: int
    save_s: float
    commit_s: float | None
    time: float | None
    stop: bool
    times: int  # how many times the step was saved
    size: int | None
    state: str
    ok: bool | None


class HostRow(HostStepTimes):
    """One host's compute time per step in one attempt (:func:`host_rows`)."""

    attempt: int


def _plan(events: list[Event]) -> PlanRecord | None:
    plans = [e for e in events if e["event"] == "plan"]
    return cast("PlanRecord", plans[-1]) if plans else None  # a plan event carries plan_record's fields


def _world(a: Attempt, plan: PlanRecord | None) -> int | None:
    n = sum(k for _, k in a.hosts)
    return n or (plan or {}).get("world_size")


def throughput_rows(g: Goodput, plan: PlanRecord | None) -> list[ThroughputRow]:
    """Per attempt: measured step time, tokens/s, model TFLOP/s and MFU (FLOPs per token and the GPU's peak from
    the plan record; MFU is n/a on CPU ranks, whose 'peak' in the plan's table is an order of magnitude only)."""
    plan = plan or {}
    fpt, peak = plan.get("flops_per_token"), plan.get("peak_tflops")
    cpu = plan.get("accelerator") == "cpu" or plan.get("gpu") == "cpu"
    out: list[ThroughputRow] = []
    for a in g.attempts:
        world = _world(a, plan)
        tps, padded = a.tokens_per_s, False
        if tps is None and a.step_time_s and plan.get("tokens_per_step"):
            tps, padded = plan["tokens_per_step"] / a.step_time_s, True  # padded tokens: an upper bound
        tflops = tps * fpt / 1e12 if tps and isinstance(fpt, (int, float)) else None
        mfu: float | None
        if cpu:
            mfu, why = None, "n/a (CPU ranks: no hardware peak to compare with)"
        elif not plan:
            mfu, why = None, "n/a (no plan record)"
        elif tflops is None or not peak or not world:
            mfu, why = None, "n/a"
        else:
            mfu, why = tflops / (peak * world), ""
        out.append(
            {
                "attempt": a.attempt,
                "world": world,
                "hosts": [h for h, _ in a.hosts],
                "resume_step": a.resume_step,
                "outcome": a.outcome,
                "startup_s": a.seconds.get("startup"),
                "kept": a.kept_steps,
                "recomputed": a.recomputed_steps,
                "step_s": a.step_time_s,
                "median_step_s": a.median_step_s,
                "tokens_per_s": tps,
                "tokens_padded": padded,
                "tflops": tflops,
                "mfu": mfu,
                "mfu_why": why,
            }
        )
    return out


@dataclass
class CheckpointTable:
    """The checkpoint table's rows and what was left out of it (:func:`checkpoint_rows`)."""

    rows: list[CheckpointRow]
    unlisted: int = 0  # older saves not listed (every one is in metrics.jsonl)
    unlisted_local: int = 0  # of those, the ones saved to a node-local tier


def checkpoint_rows(run: Path, g: Goodput, limit: int = MAX_CHECKPOINT_ROWS) -> CheckpointTable:
    """Every checkpoint on disk (the run directory's, final/, those a restart set aside), and the newest saves the
    run committed (metrics' commit records) up to ``limit`` rows in all: a run saving to a local tier every step
    has a million saves. Each with its tier (local: a node-local tier; durable: the run directory; local, then
    durable: copied there by the checkpoint agents), size, save time and verification state (sizes of every file
    against its commit record; no hashing)."""

    try:
        on_disk = dict(list_checkpoints(run))
        aside = list_set_aside(run)
    except OSError:
        on_disk, aside = {}, []
    saved = {c.step for a in g.attempts for c in a.commits}
    newest = heapq.nlargest(max(0, limit - len(on_disk) - len(aside) - 1), saved - set(on_disk))
    listed = set(newest) | set(on_disk)
    saves: dict[int, CheckpointRow] = {}
    tiers: dict[int, set[str]] = {}
    unlisted_local: set[int] = set()
    for a in g.attempts:
        for c in a.commits:
            if c.step not in listed and c.tier == "local":
                unlisted_local.add(c.step)
        for c, s0, s1 in save_spans(a, only=listed):
            prev = saves.get(c.step)
            tiers.setdefault(c.step, set()).add(c.tier)
            saves[c.step] = {
                "attempt": c.attempt,
                "save_s": s1 - s0,
                "commit_s": c.commit_s,
                "time": c.time,
                "stop": c.stop,
                "times": (prev["times"] + 1) if prev else 1,
            }
    rows = []
    for step in sorted(listed):
        s = saves.get(step, {})
        name = f"checkpoint-{step}"
        local = "local" in tiers.get(step, set())
        durable = step in on_disk or step in g.copied
        tier = ("local, then durable" if durable else "local") if local else TIER
        row: CheckpointRow = {"name": name, "step": step, "tier": tier, **s, "size": None}
        if step in on_disk:
            v = verify(on_disk[step], checksums=False)
            row["size"] = _record_size(v.record)
            row["state"] = "verified (sizes)" if v.ok else f"rejected: {v.reason}"
            row["ok"] = v.ok
        elif local and not durable:
            row["state"], row["ok"] = "in the local tier only (rotated, or removed with the tier)", None
        elif step in g.rotated:
            row["state"], row["ok"] = "deleted by rotation (save_total_limit)", None
        else:
            row["state"], row["ok"] = "not on disk", None
        rows.append(row)
    for _, p in aside:
        rows.append({"name": p.name, "step": None, "tier": TIER, "size": None, "state": "set aside by a restart"})
    final = RunDir(run).final
    if final.exists():
        v = verify(final, checksums=False)
        rows.append(
            {
                "name": "final",
                "step": (v.record or {}).get("step"),
                "tier": TIER,
                "size": _record_size(v.record),
                "state": "verified (sizes)" if v.ok else f"rejected: {v.reason}",
                "ok": v.ok,
                "time": (v.record or {}).get("created"),
            }
        )
    return CheckpointTable(rows, len(saved - listed), len(unlisted_local))


def _record_size(record: CommitRecord | None) -> int | None:
    files = record.get("files") if record else None
    if not isinstance(files, dict):
        return None
    return sum(int(f.get("size") or 0) for f in files.values() if isinstance(f, dict))


def host_rows(g: Goodput) -> list[HostRow]:
    """Per attempt and host, the compute time per step the supervisor recorded at the attempt's end."""
    out: list[HostRow] = []
    for a in g.attempts:
        rec = next((e for e in a.events if e["event"] == "step_times"), None)
        for h in (rec or {}).get("hosts") or []:
            if isinstance(h, dict) and isinstance(h.get("compute_s"), (int, float)):
                out.append({"attempt": a.attempt, **h})
    return out


# ------------------------------------------------------------------------------------------------ page


def build_report(run_dir: str | Path) -> str:
    """The page for RUN_DIR, from its events.jsonl and metrics.jsonl (and its checkpoints' commit records)."""

    rd = RunDir(run_dir)
    skipped: dict[str, int] = {}
    raw_events = read_events(rd.events, skipped)
    metrics = iter_metrics(rd.metrics, skipped)  # read once, as goodput keeps only what it needs
    events = timed_events(raw_events)
    g = goodput(events, metrics)
    tl = build_timeline(events, g)
    plan = _plan(events)
    through = throughput_rows(g, plan)
    ckpts = checkpoint_rows(rd.path, g)
    hosts = host_rows(g)
    title = f"ftkit report: {rd.path.resolve().name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        _header(rd, g, events, skipped),
        _goodput_section(g, charts.breakdown_chart(g)),
        _loss_section(g, charts.loss_chart(g.attempts)),
        _timeline_section(tl, events, charts.timeline_chart(tl, g.attempts)),
        _throughput_section(through, plan),
        _hosts_section(hosts, charts.host_chart(_host_chart_rows(hosts))),
        _checkpoint_section(ckpts),
        _plan_section(plan, through),
        _footer(rd),
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p)


def is_report_page(path: Path) -> bool:
    """A page :func:`write_report` wrote (what ``ftkit report`` may replace without ``--force``)."""
    return starts_with(path, b"<!DOCTYPE html>", b"<title>ftkit report: ")


def write_report(run_dir: str | Path, out: str | Path | None = None, *, force: bool = False) -> Path:
    """``ftkit report``: write the page (default ``RUN_DIR/report.html``) atomically; returns its path. Refused
    (exit 2, nothing written): a path in a run's own state, in a directory that does not exist, or over a file
    that is not a report page unless ``force`` (:mod:`ftkit.rundir.outputs`)."""
    run = Path(run_dir)
    if not run.exists():
        raise UserError(Problem("does not exist [give the run's train.output_dir]", file=str(run_dir)))
    if not run.is_dir():
        raise UserError(Problem("not a directory [give the run's train.output_dir]", file=str(run_dir)))
    if not RunDir(run).events.exists() and not RunDir(run).meta.is_dir():
        raise UserError(Problem("not an ftkit run directory (no events.jsonl)", file=str(run_dir)))
    target = check_output_file(
        Path(out) if out is not None else run / "report.html",
        ours=is_report_page,
        force=force,
        what="report page",
        key="-o",
    )
    page = build_report(run)
    try:
        atomic_write(target, page)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(
                f"{target}: cannot write the report: no space left on {e.filename or target.parent}"
            ) from None
        raise UserError(
            Problem(f"cannot write the report ({e.strerror or e}) [give a writable file path]", file=str(target))
        ) from None
    return target


def _header(rd: RunDir, g: Goodput, events: list[Event], skipped: dict[str, int]) -> str:
    outcome = next((e for e in reversed(events) if e["event"] in ENDS), None)
    state = (
        "running (or its supervisor was stopped): the page shows it up to its newest record"
        if g.live
        else (str(outcome.get("message") or outcome["event"]) if outcome else "no outcome recorded")
    )
    steps = [s for a in g.attempts for s in a.steps]
    last = max((s.step for s in steps), default=None)
    restarts = sum(1 for e in events if e["event"] == "restart")
    ratio = f"{g.ratio:.1%}" if g.ratio is not None else "n/a"
    big = g.largest_loss
    cards = [
        ("goodput", ratio, "productive training / wall time"),
        ("wall time", fmt_s(g.wall_s), f"{g.launches} launch{'es' if g.launches != 1 else ''}"),
        ("productive", fmt_s(g.productive_s), "kept step intervals"),
        (
            "largest loss",
            fmt_s(big[1]) if big else "-",
            dict((k, lbl) for k, lbl, _ in CATEGORIES)[big[0]] if big else "",
        ),
        ("attempts", str(len(g.attempts)), f"{restarts} restart{'s' if restarts != 1 else ''}"),
        ("step", str(last) if last is not None else "-", "newest logged"),
    ]
    card_html = "".join(
        f'<div class="card"><span>{_e(a)}</span><b>{_e(b)}</b><span>{_e(c)}</span></div>' for a, b, c in cards
    )
    notes = [f"{name}: {n} malformed line(s) skipped" for name, n in sorted(skipped.items())]
    first = g.spans[0][0] if g.spans else None
    lines = [
        f"<p>run directory <code>{_e(rd.path.resolve())}</code><br>",
        f"outcome: <b>{_e(state)}</b><br>",
        f"started {_e(_clock(first))}; page made {_e(_clock(time.time()))}</p>",
        f'<div class="cards" id="summary">{card_html}</div>',
    ]
    if notes:
        lines.append(f'<p class="note">{_e("; ".join(notes))}</p>')
    return "\n".join(lines)


def _goodput_section(g: Goodput, chart: str | None) -> str:

    rows = []
    for key, label, what in CATEGORIES:
        v = g.breakdown.get(key, 0.0)
        share = v / g.wall_s if g.wall_s > 0 else 0.0
        rows.append([_Html(f"{_swatch(CATEGORY_COLOURS[key])} {_e(label)}"), f"{v:.2f}", f"{share:.1%}", what])
    extra = []
    if g.idle_s > 0:
        extra.append(f"Between launches (nothing ran, not in the wall time): {fmt_s(g.idle_s)}.")
    if g.straggler_s is not None:
        extra.append(
            f"Of the productive time, about {fmt_s(g.straggler_s)} was spent waiting for the slowest host "
            "(estimate: slowest minus median host compute per step, times the kept steps)."
        )
    else:
        extra.append("Straggler cost: n/a (one host, or no per-host compute times recorded).")
    return (
        '<section id="goodput"><h2>Where the time went: goodput</h2>'
        + (f"<figure>{chart}</figure>" if chart else "")
        + _table(["category", "seconds", "share of wall", "what it is"], rows, num=(1, 2), cls="breakdown")
        + f'<p class="note">Goodput = {_e(DEFINITION)}. An attempt\'s first logged step has no previous one: its '
        "interval is counted in start-up. " + _e(" ".join(extra)) + "</p></section>"
    )


def _loss_section(g: Goodput, chart: str | None) -> str:
    if chart is None:
        return '<section id="loss"><h2>Loss</h2><p>No loss logged yet.</p></section>'
    recomputed = [a for a in g.attempts if a.recomputed_steps]
    note = (
        "Dotted, over a red band: steps a failed attempt computed that a later attempt computed again "
        + ", ".join(f"(attempt {a.attempt}: {a.recomputed_steps} logged step(s))" for a in recomputed)
        + "; on CPU they coincide exactly. "
        if recomputed
        else "No step was recomputed. "
    )
    return (
        '<section id="loss"><h2>Loss and eval loss</h2>'
        f"<figure>{chart}<figcaption>{_e(note)}Dashed vertical lines: the step each restart resumed from."
        "</figcaption></figure></section>"
    )


NOTABLE = {
    "preflight",
    "fresh_start",
    "checkpoint_chosen",
    "checkpoint_rejected",
    "set_aside",
    "converted",
    "launch",
    "failure",
    "host_lost",
    "restart",
    "shrink",
    "stop_requested",
    "stopped",
    "finished",
    "gave_up",
    "interrupted",
    "refused",
    "failed",
    "straggler",
    "exclude_stragglers",
    "resume_mismatch",
    "resume_changes",
    "slurm",
    "takeover",
    "discarded",
    "build_lock",
    "args_changed",
}


def _timeline_section(tl: Timeline, events: list[Event], chart: str | None) -> str:
    t0 = tl.start_epoch
    rows: list[list[object]] = []
    for e in events:
        if e["event"] not in NOTABLE and not (e["event"] == "teardown" and e.get("message")):
            continue
        msg = e.get("message") or ""
        if e["event"] == "failure" and e.get("dead_ranks"):
            msg = f"{msg} (dead ranks {e['dead_ranks']})"
        if len(rows) == MAX_ROWS:
            rows.append(["", "", "", "...", "more decisions in events.jsonl"])
            break
        rows.append(
            [
                f"{float(e['time']) - t0:.1f}" if t0 is not None else "-",
                _clock(float(e["time"])),
                e.get("attempt", ""),
                e["event"],
                str(msg)[:400],
            ]
        )
    phases = "; ".join(f"{k}: {v}" for k, v in PHASES.items())
    return (
        '<section id="timeline"><h2>Timeline of attempts per host</h2>'
        + (f"<figure>{chart}<figcaption>{_e(phases)}.</figcaption></figure>" if chart else "<p>No attempt yet.</p>")
        + "<details open><summary>Decisions (events.jsonl)</summary>"
        + _table(["s since start", "time", "attempt", "event", "message"], rows, num=(0,), cls="events")
        + "</details></section>"
    )


def _throughput_section(rows: list[ThroughputRow], plan: PlanRecord | None) -> str:
    body = []
    for r in rows:
        tps = _num(r["tokens_per_s"], "{:,.0f}")
        if r["tokens_padded"] and r["tokens_per_s"]:
            tps = f"≤ {tps}"
        body.append(
            [
                r["attempt"],
                f"{', '.join(r['hosts'])} ({r['world'] or '?'} ranks)",
                r["resume_step"] if r["resume_step"] >= 0 else "?",
                r["outcome"],
                _num(r["startup_s"], "{:.1f}"),
                f"{r['kept']} / {r['recomputed']}",
                _num(r["median_step_s"], "{:.3f}"),
                tps,
                _num(r["tflops"], "{:.4g}"),
                f"{r['mfu']:.1%}" if r["mfu"] is not None else r["mfu_why"],
            ]
        )
    fpt = (plan or {}).get("flops_per_token")
    src = (
        f"Model FLOPs: {fpt:.4g} per token (the plan's compute model) x tokens/s; peak: "
        f"{_num((plan or {}).get('peak_tflops'), '{:g}')} TFLOP/s per {(plan or {}).get('gpu_doc') or 'GPU'}."
        if isinstance(fpt, (int, float))
        else "No plan record with a compute model: TFLOP/s and MFU are n/a."
    )
    return (
        '<section id="throughput"><h2>Throughput per attempt</h2>'
        + _table(
            [
                "attempt",
                "hosts",
                "resumed from step",
                "outcome",
                "start-up s",
                "logged steps kept / recomputed",
                "step s (median)",
                "tokens/s",
                "TFLOP/s (all ranks)",
                "MFU",
            ],
            body,
            num=(0, 2, 4, 6, 7, 8),
            cls="throughput",
        )
        + f'<p class="note">Step time: median of the intervals between logged steps with no save or evaluation in '
        f"them, per optimizer step. Tokens: tokens_seen in metrics.jsonl (non-padding tokens, all ranks); "
        f"'≤' marks an upper bound from the batch shape when a record has none. {_e(src)}</p></section>"
    )


def _host_chart_rows(hosts: list[HostRow]) -> list[tuple[int, str, float, bool]]:
    return [(h["attempt"], str(h.get("host")), float(h["compute_s"]), bool(h.get("straggler"))) for h in hosts]


def _hosts_section(hosts: list[HostRow], chart: str | None) -> str:
    if not hosts:
        return (
            '<section id="hosts"><h2>Step time per host</h2><p>No per-host compute times recorded (ftkit records '
            "them at the end of each attempt).</p></section>"
        )
    rows = [
        [
            h["attempt"],
            h.get("host"),
            ", ".join(str(r) for r in h.get("ranks") or []),
            f"{h['compute_s'] * 1000:.2f}",
            _num(h.get("score"), "{:.2f}x"),
            h.get("steps", ""),
            _Html('<span class="bad">straggler</span>') if h.get("straggler") else "",
        ]
        for h in hosts
    ]
    return (
        '<section id="hosts"><h2>Step time per host</h2>'
        + (f"<figure>{chart}</figure>" if chart else "")
        + _table(
            ["attempt", "host", "ranks", "compute ms/step", "vs other hosts", "steps measured", ""],
            rows,
            num=(0, 3, 4, 5),
            cls="hosts",
        )
        + '<p class="note">Each rank times its own forward passes per step (an EWMA, in its heartbeat); a host is the '
        "median of its ranks. In lock-step training every step waits for the slowest host; a host 1.5x slower than "
        "the others after 10 steps is named a straggler.</p></section>"
    )


def _checkpoint_section(table: CheckpointTable) -> str:
    body: list[list[object]] = []
    for r in table.rows:
        state = r.get("state", "")
        cls = "ok" if r.get("ok") else ("bad" if r.get("ok") is False else "")
        body.append(
            [
                r["name"],
                r.get("step") if r.get("step") is not None else "",
                r["tier"],
                _bytes(r.get("size")),
                _num(r.get("save_s"), "{:.2f}"),
                _num(r.get("commit_s"), "{:.3f}"),
                (f"{r.get('attempt')}" if r.get("attempt") is not None else "")
                + (" (graceful stop)" if r.get("stop") else "")
                + (f", saved {r['times']}x" if r.get("times", 1) > 1 else ""),
                _Html(f'<span class="{cls}">{_e(state)}</span>'),
            ]
        )
    return (
        '<section id="checkpoints"><h2>Checkpoints</h2>'
        + (
            _table(
                ["checkpoint", "step", "tier", "size", "save s", "commit s", "attempt", "state"],
                body,
                num=(1, 3, 4, 5),
                cls="checkpoints",
            )
            if body
            else "<p>No checkpoint yet.</p>"
        )
        + (
            f'<p class="note" id="checkpoints-unlisted">{table.unlisted:,} older save(s) not listed'
            + (f" ({table.unlisted_local:,} of them to the local tier)" if table.unlisted_local else "")
            + ": metrics.jsonl has a commit record of each.</p>"
            if table.unlisted
            else ""
        )
        + '<p class="note">Verification done for this page: every file listed in the commit record exists with its '
        "recorded size (no hashing; <code>ftkit status --verify</code> re-reads every byte against its checksum, and "
        "a resume always does). Save: from the step's log record to its commit record; commit: ftkit's barrier and "
        "commit record. Tier: durable = saved in the run directory (shared storage); local = saved in the node-local "
        "tier (checkpoint.local_dir, e.g. /dev/shm), which holds a few steps and is removed at the end of a launch; "
        "local, then durable = copied to the run directory by the checkpoint agents.</p></section>"
    )


def _plan_section(plan: PlanRecord | None, through: list[ThroughputRow]) -> str:
    if plan is None:
        return (
            '<section id="plan"><h2>Plan</h2><p>No plan record in events.jsonl (runs launched by an older ftkit do '
            "not have one).</p></section>"
        )
    measured = [r["median_step_s"] for r in through if r["median_step_s"]]
    pred = plan.get("predicted_step_s")
    rows: list[list[object]] = [
        ["engine, hosts", f"{plan.get('engine')} on {', '.join(f'{h} ({n})' for h, n in plan.get('hosts') or [])}"],
        ["world size", plan.get("world_size")],
        [
            "ZeRO stage",
            f"{plan.get('stage')} (optimizer offload {plan.get('offload_optimizer')}, parameter offload "
            f"{plan.get('offload_params')})",
        ],
        [
            "batch",
            f"{plan.get('global_batch_size')} = micro {plan.get('micro_batch_size')} x accumulation "
            f"{plan.get('grad_accum')} x {plan.get('world_size')} ranks; sequence length {plan.get('seq_len')}; "
            f"{plan.get('precision')}",
        ],
    ]
    if plan.get("not_estimated"):
        rows.append(["memory and step time", f"not estimated: {plan['not_estimated']}"])
    else:
        rows += [
            [
                "memory per GPU (predicted)",
                f"{_num(plan.get('memory_gib_per_gpu'), '{:.2f}')} GiB of {plan.get('gpu_memory_gb')} GiB",
            ],
            [
                "device",
                f"{plan.get('gpu')} ({plan.get('gpu_doc')}; {plan.get('gpu_source')}): peak "
                f"{_num(plan.get('peak_tflops'), '{:g}')} TFLOP/s",
            ],
            [
                "model",
                f"{_num(plan.get('total_params'), '{:,}')} parameters, {_num(plan.get('trainable_params'), '{:,}')} "
                f"trainable; {_num(plan.get('flops_per_token'), '{:.4g}')} FLOPs per token",
            ],
            [
                "step time",
                f"predicted {_num(pred, '{:.4g}')} s (compute {_num(plan.get('predicted_compute_s'), '{:.3g}')} s at "
                f"an assumed MFU of {_num(plan.get('assumed_mfu'), '{:.0%}')}, exposed communication "
                f"{_num(plan.get('predicted_exposed_comm_s'), '{:.3g}')} s); measured "
                + (", ".join(f"{m:.4g} s" for m in measured) or "-")
                + " (median per attempt)"
                + (
                    f"; measured / predicted {measured[-1] / pred:.2f}x"
                    if measured and isinstance(pred, (int, float)) and pred > 0
                    else ""
                ),
            ],
        ]
    return '<section id="plan"><h2>Plan</h2>' + _table(["", ""], rows, cls="plan") + "</section>"


def _footer(rd: RunDir) -> str:
    return (
        '<p class="note" id="sources">Every number on this page comes from <code>events.jsonl</code> (the '
        "supervisor's decisions, its clock) and <code>metrics.jsonl</code> (rank 0's records, its clock) in the run "
        "directory, except the checkpoints' state, read from their commit records. Made by <code>ftkit report "
        f"{_e(rd.path)}</code>; the page has no script and makes no request.</p>"
    )
