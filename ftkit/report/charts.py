"""The report's charts as inline SVG, drawn with matplotlib's SVG backend (imported here, on first use only).

Why matplotlib's SVG: ftkit already uses matplotlib for ``ftkit status --plot``; its SVG is one self-contained
element per chart (no script, no font or network fetch: text stays text with ``svg.fonttype: none``), it scales and
prints sharply, and every drawn series gets an ``id`` (``set_gid``) that a test or a reader's tool can find. A
JavaScript plotting library bundled into the page would add hundreds of KB of script for interactivity a printed
report cannot use.
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from ftkit.errors import UserError
from ftkit.report.goodput import CATEGORIES, Attempt, Goodput
from ftkit.report.timeline import MARKS, PHASES, Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.container import BarContainer
    from matplotlib.figure import Figure

T = TypeVar("T")
P = ParamSpec("P")

# Okabe-Ito (colour-blind safe), then greys
ATTEMPT_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
CATEGORY_COLOURS = {
    "productive": "#009E73",
    "startup": "#56B4E9",
    "recomputed": "#D55E00",
    "saves": "#0072B2",
    "evaluation": "#CC79A7",
    "detection": "#E69F00",
    "teardown": "#999999",
    "backoff": "#F0E442",
    "other": "#DDDDDD",
}
PHASE_STYLE: dict[str, dict[str, str | None]] = {
    "startup": {"color": "#BBBBBB", "hatch": None},
    "training": {"color": None, "hatch": None},  # the attempt's colour
    "ending": {"color": "#555555", "hatch": None},
    "backoff": {"color": "#F0E442", "hatch": "//"},
}
MARK_STYLE = {  # marker, colour
    "failure": ("X", "#D00000"),
    "restart": ("o", "#444444"),
    "stop_requested": ("v", "#0072B2"),
    "stopped": ("s", "#0072B2"),
    "finished": ("*", "#009E73"),
    "shrink": ("<", "#CC79A7"),
    "host_lost": ("X", "#000000"),
    "straggler": ("D", "#E69F00"),
    "slurm": ("^", "#666666"),
    "gave_up": ("X", "#000000"),
    "interrupted": ("X", "#666666"),
    "launch_boundary": ("|", "#000000"),
}


def attempt_colour(i: int) -> str:
    return ATTEMPT_COLOURS[i % len(ATTEMPT_COLOURS)]


def plain_text(draw: Callable[P, T]) -> Callable[P, T]:
    """Draw with every text as written: a host or run directory name may hold ``$``, which matplotlib would read as
    mathtext (and raise on, e.g. ``node$x``). Text objects take the setting when they are made, tick labels when
    drawn: the whole drawing, saving included, runs inside it."""

    @functools.wraps(draw)
    def drawn(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            import matplotlib
        except ImportError:
            raise UserError("ftkit report needs matplotlib: pip install 'ftkit[plot]'") from None
        with matplotlib.rc_context({"text.parse_math": False}):
            return draw(*args, **kwargs)

    return drawn


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("ftkit report needs matplotlib: pip install 'ftkit[plot]'") from None
    return Figure(figsize=(width, height), dpi=96)


def to_svg(fig: Figure, name: str, title: str) -> str:
    """The figure as one ``<svg>`` element for an HTML page: no XML prologue, ids unique to this chart, scalable."""
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    svg = re.sub(r'^<svg ([^>]*?)width="[^"]*" height="[^"]*"', r"<svg \1", svg, count=1)
    # matplotlib names glyph/clip ids per chart with the salt; prefix the rest so two charts never share an id
    svg = svg.replace("<svg ", f'<svg id="{name}" role="img" aria-label="{title}" class="chart" ', 1)
    return svg


def _gid(container: BarContainer, name: str) -> None:
    """An id on each drawn bar (a BarContainer has none of its own)."""
    patches = list(container)
    for i, patch in enumerate(patches):
        patch.set_gid(name if len(patches) == 1 else f"{name}-{i}")


def _style(ax: Axes) -> None:
    ax.grid(alpha=0.3)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


# ------------------------------------------------------------------------------------------------ loss


MAX_POINTS = 4000  # per line: a long run's loss is drawn from every k-th logged step (the SVG stays small)


def thin(points: list[T]) -> list[T]:
    """Every k-th point (the last one kept) so that at most :data:`MAX_POINTS` are drawn."""
    k = -(-len(points) // MAX_POINTS)
    return points if k <= 1 else points[::k] + ([points[-1]] if (len(points) - 1) % k else [])


@dataclass(frozen=True)
class LossAxis:
    """The loss chart's upper limit, and the points above it (:func:`loss_axis`)."""

    top: float | None  # None: every point fits, matplotlib's own limits
    off: list[tuple[int, float]]  # (step, loss) drawn as a marker at the top edge instead


REFERENCE_SHARE = 0.01  # the start of training: the first 1% of the logged steps (at least REFERENCE_MIN)
REFERENCE_MIN = 5


def loss_axis(atts: list[Attempt]) -> LossAxis:
    """One diverged step (a loss of 1e6 among losses of 2 to 11) made every other point a flat line at the bottom.
    A healthy loss stays below where training started, so the axis reaches the highest loss of the first logged
    steps (:data:`REFERENCE_SHARE`) plus the whole range the curve spans below it; points above are divergence and
    are marked at the top edge with their values, not scaled to."""
    points = sorted((s.step, s.loss) for a in atts for s in a.steps)
    evals = [(e.step, e.loss) for a in atts for e in a.evals]
    if not points:
        return LossAxis(None, [])
    k = max(REFERENCE_MIN, math.ceil(len(points) * REFERENCE_SHARE))
    ref = max(loss for _, loss in points[:k])
    low = min(loss for _, loss in points + evals)
    cap = ref + max(ref - low, abs(ref), 1e-12)
    off = [(step, loss) for step, loss in points + evals if loss > cap]
    if not off:
        return LossAxis(None, [])
    shown = max(loss for _, loss in points + evals if loss <= cap)
    return LossAxis(shown + 0.08 * max(shown - low, abs(shown), 1e-12), sorted(off))


@plain_text
def loss_chart(atts: list[Attempt]) -> str | None:
    """Loss against step, one colour per attempt; the steps a later attempt recomputed drawn dotted over a red
    band; eval loss as crosses; a dashed line where each restart resumed."""
    if not any(a.steps for a in atts):
        return None
    fig = _figure(8.6, 3.8)
    ax: Axes = fig.subplots()
    for i, a in enumerate(atts):
        colour = attempt_colour(i)
        kept = thin([s for s in a.steps if s.step <= a.kept_until])
        gone = thin([s for s in a.steps if s.step > a.kept_until])
        if kept:
            (line,) = ax.plot(
                [s.step for s in kept], [s.loss for s in kept], marker=".", color=colour, label=f"attempt {a.attempt}"
            )
            line.set_gid(f"loss-attempt-{a.attempt}")
        if gone:
            lo, hi = a.kept_until, max(s.step for s in gone)
            band = ax.axvspan(lo, hi, color="#D55E00", alpha=0.12, lw=0)
            band.set_gid(f"recomputed-band-{a.attempt}")
            (line,) = ax.plot(
                [s.step for s in gone],
                [s.loss for s in gone],
                marker="o",
                markerfacecolor="none",
                linestyle=":",
                linewidth=2,
                alpha=0.6,
                color=colour,
                label=f"attempt {a.attempt}: step{f's {lo + 1}-{hi}' if hi > lo + 1 else f' {hi}'} recomputed later",
            )
            line.set_gid(f"recomputed-attempt-{a.attempt}")
        if a.resume_step > 0:
            ax.axvline(a.resume_step, color="#444444", linestyle="--", linewidth=0.8).set_gid(f"resume-{a.attempt}")
    evals = {}
    for a in atts:  # per step, the newest attempt's evaluation
        for e in a.evals:
            evals[e.step] = e.loss
    if evals:
        steps = thin(sorted(evals))
        (line,) = ax.plot(
            steps, [evals[s] for s in steps], marker="x", linestyle="--", color="black", label="eval loss", zorder=4
        )
        line.set_gid("eval-loss")
    axis = loss_axis(atts)
    if axis.top is not None:
        ax.set_ylim(top=axis.top)
        worst = max(axis.off, key=lambda p: p[1])
        shown = thin(axis.off)
        pts = ax.scatter(
            [s for s, _ in shown],
            [axis.top] * len(shown),
            marker="^",
            color="#D00000",
            zorder=5,
            clip_on=False,
            label=f"{len(axis.off)} step(s) off the chart, above {axis.top:.3g} (largest {worst[1]:.3g} at step "
            f"{worst[0]})",
        )
        pts.set_gid("loss-off-chart")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    _style(ax)
    ax.legend(fontsize=8, loc="upper right")
    return to_svg(fig, "loss-chart", "loss and eval loss against step, per attempt")


# ------------------------------------------------------------------------------------------------ timeline


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s > 3 * 3600:
        return 3600.0, "h"
    if span_s > 300:
        return 60.0, "min"
    return 1.0, "s"


@plain_text
def timeline_chart(tl: Timeline, atts: list[Attempt]) -> str | None:
    """One row per host: each attempt's start-up, training and ending; backoff hatched; decisions as markers."""
    if not tl.bars and not tl.marks:
        return None
    unit, name = _time_unit(tl.span_s)
    rows = tl.rows()
    colours = {a.attempt: attempt_colour(i) for i, a in enumerate(atts)}
    fig = _figure(8.6, 1.5 + 0.45 * len(rows))
    ax: Axes = fig.subplots()
    seen_phase: set[str] = set()
    for b in tl.bars:
        style = PHASE_STYLE[b.phase]
        colour = style["color"] or colours.get(b.attempt, "#0072B2")
        label = None
        if b.phase != "training" and b.phase not in seen_phase:  # one legend entry per phase
            label = PHASES[b.phase]
            seen_phase.add(b.phase)
        bars = ax.barh(
            rows[b.host],
            (b.end - b.start) / unit,
            left=b.start / unit,
            height=0.5,
            color=colour,
            hatch=style["hatch"],
            edgecolor="#333333" if style["hatch"] else colour,
            linewidth=0.4,
            label=label,
        )
        _gid(bars, f"timeline-{b.phase}-attempt-{b.attempt}-{rows[b.host]}")
        if b.phase == "training" and (b.end - b.start) / max(tl.span_s, 1e-9) > 0.06:
            ax.text(
                (b.start + b.end) / 2 / unit, rows[b.host], f"attempt {b.attempt}", ha="center", va="center", fontsize=7
            )
    seen_mark: set[str] = set()
    for i, m in enumerate(tl.marks):
        marker, colour = MARK_STYLE.get(m.kind, ("o", "black"))
        ys = [rows[h] for h in m.hosts if h in rows] or list(rows.values())
        if m.kind == "launch_boundary":
            ax.axvline(m.time / unit, color="black", linestyle="-.", linewidth=0.8).set_gid(f"mark-{m.kind}-{i}")
            continue
        label = None if m.kind in seen_mark else MARKS[m.kind]
        seen_mark.add(m.kind)
        above = m.kind in ("failure", "host_lost", "gave_up", "interrupted", "straggler")  # what went wrong: above
        pts = ax.scatter(
            [m.time / unit] * len(ys),
            [y + (-0.4 if above else 0.4) for y in ys],
            marker=marker,
            color=colour,
            s=40,
            zorder=5,
            label=label,
        )
        pts.set_gid(f"mark-{m.kind}-{i}")
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_ylim(len(rows) - 0.4, -0.65)  # first host on top, room for the markers above and below
    ax.set_xlabel(f"run time ({name}; gaps between launches removed)")
    ax.set_xlim(0, max(tl.span_s, 1e-9) / unit * 1.02)
    _style(ax)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.15), ncol=4)
    return to_svg(fig, "timeline-chart", "timeline of attempts per host")


# ------------------------------------------------------------------------------------------------ goodput


@plain_text
def breakdown_chart(g: Goodput) -> str | None:
    """The wall time as one stacked bar, by category."""
    if g.wall_s <= 0:
        return None
    fig = _figure(8.6, 0.75)
    ax: Axes = fig.subplots()
    left = 0.0
    for key, label, _ in CATEGORIES:
        v = g.breakdown.get(key, 0.0)
        if v <= 0:
            continue
        share = v / g.wall_s
        bars = ax.barh(0, share * 100, left=left, color=CATEGORY_COLOURS[key], edgecolor="white", linewidth=0.5)
        bars.set_label(f"{label} {share:.1%}")
        _gid(bars, f"breakdown-{key}")
        if share > 0.07:
            ax.text(left + share * 50, 0, f"{share:.0%}", ha="center", va="center", fontsize=8)
        left += share * 100
    ax.set_xlim(0, 100)
    ax.set_yticks([])
    ax.set_xlabel("% of wall time")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.75), ncol=5, frameon=False)
    return to_svg(fig, "breakdown-chart", "where the wall time went")


@plain_text
def host_chart(rows: list[tuple[int, str, float, bool]]) -> str | None:
    """Compute time per step by host and attempt: (attempt, host, seconds, straggler)."""
    if not rows:
        return None
    hosts = list(dict.fromkeys(h for _, h, _, _ in rows))
    attempts = list(dict.fromkeys(a for a, _, _, _ in rows))
    fig = _figure(8.6, 1.0 + 0.35 * len(hosts) * max(1, len(attempts)) ** 0.5)
    ax: Axes = fig.subplots()
    height = 0.8 / len(attempts)
    for j, a in enumerate(attempts):
        for i, h in enumerate(hosts):
            vals = [(s, slow) for att, host, s, slow in rows if att == a and host == h]
            if not vals:
                continue
            s, slow = vals[0]
            bar = ax.barh(
                i + j * height,
                s * 1000,
                height=height * 0.9,
                color=attempt_colour(j),
                edgecolor="#D00000" if slow else attempt_colour(j),
                linewidth=1.5 if slow else 0.4,
                label=f"attempt {a}" if i == 0 else None,
            )
            _gid(bar, f"host-{i}-attempt-{a}")
    ax.set_yticks([i + height * (len(attempts) - 1) / 2 for i in range(len(hosts))], hosts)
    ax.invert_yaxis()
    ax.set_xlabel("compute per step (ms; forward passes, EWMA)")
    _style(ax)
    ax.legend(fontsize=7)
    return to_svg(fig, "host-chart", "compute time per step by host")
