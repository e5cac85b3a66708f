"""The progress line of ``ftkit launch``: step/total, loss, samples/s, tokens/s, elapsed and ETA.

The supervisor feeds it rank 0's ``metrics.jsonl`` records as they appear (:class:`MetricsTail` reads the new
complete lines of the file on each poll) and calls :meth:`Progress.update` with each, :meth:`Progress.finish` at
the end. On a terminal the line is rewritten in place (``\\r``, the text cut to the terminal's width so it never
wraps, then "clear to end of line"); :meth:`Progress.message` prints a line of its own above it. When the output
is not a terminal (CI logs, ``| tee``), it prints plain lines instead: the first record, then at most one line
every ``interval_s`` seconds (30 by default), and the last state at the end, so a log stays short and readable.

Rates come from the records' own timestamps (rank 0's clock, differences only): steps/s over the last
``WINDOW`` logged steps of the current attempt; samples/s = global batch × steps/s; tokens/s from the
``tokens_seen`` counter HF Trainer keeps (``include_num_input_tokens_seen``). A restart starts a new window (the
time the restart took is not a training rate). Elapsed time is the supervisor's own (monotonic) clock; ETA is
the remaining steps at the current rate. Import-light: the standard library only.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, cast

from ftkit.rundir.records import MetricsRecord, as_number

WINDOW = 20  # logged steps the rates are averaged over: smooth, yet they follow a real slowdown within a minute
INTERVAL_S = 30.0  # seconds between plain lines when the output is not a terminal
CLEAR_EOL = "\x1b[K"


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (``D days, H:MM:SS`` past a day); ``--`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    text = f"{h}:{m:02d}:{s:02d}"
    return f"{days}d {text}" if days else text


def format_rate(x: float) -> str:
    """Three significant figures, with k/M for thousands and millions: 0.512, 9.60, 245, 12.3k, 1.05M."""
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


class Progress:
    """One progress line, fed metrics records; ``stream`` defaults to stdout, a terminal or not decides the form."""

    def __init__(
        self,
        *,
        total_steps: int | None,
        global_batch: int,
        stream: TextIO | None = None,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        tty: bool | None = None,
    ):
        import sys

        self.stream = stream if stream is not None else sys.stdout
        self.total = total_steps if total_steps and total_steps > 0 else None
        self.global_batch = global_batch
        self.interval_s = interval_s
        self.clock = clock
        self.tty = self._is_tty() if tty is None else tty
        self.started = clock()
        self.step: int | None = None
        self.loss: float | None = None
        self.eval_loss: float | None = None
        self.attempt: int | None = None
        self._window: deque[tuple[float, int, float | None]] = deque(maxlen=WINDOW + 1)  # (time, step, tokens)
        self._shown = False  # a line is on the terminal now (tty) / the latest state was printed (plain)
        self._last_print: float | None = None

    def _is_tty(self) -> bool:
        try:
            return self.stream.isatty() and os.environ.get("TERM") != "dumb"
        except (AttributeError, ValueError, OSError):
            return False

    # ------------------------------------------------------------------------------------------------ feeding

    def update(self, record: MetricsRecord) -> None:
        """Take one metrics.jsonl record: a logged step (step, loss, time, tokens_seen, attempt) or an evaluation
        (step, eval_loss); anything else (commit events, malformed lines) is ignored."""
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return
        if "eval_loss" in record:
            self.eval_loss = as_number(record["eval_loss"])
            self._render(force=False)
            return
        if "loss" not in record or "event" in record:
            return
        attempt = record.get("attempt")
        if attempt != self.attempt or (self.step is not None and step <= self.step):
            self._window.clear()  # a restart (or a resume that recomputes steps): the gap is not a training rate
        self.attempt = attempt
        self.step = step
        self.loss = as_number(record.get("loss"))
        t = as_number(record.get("time"))
        if t is not None:
            self._window.append((t, step, as_number(record.get("tokens_seen"))))
        self._render(force=False)

    def finish(self) -> None:
        """End the line: a newline after the in-place line on a terminal, the last state as a plain line elsewhere."""
        if self.tty:
            if self._shown:
                self._render(force=True)
                self.stream.write("\n")
        elif self.step is not None and not self._shown:
            self._write_plain()
        self._shown = False
        self._flush()

    def message(self, text: str) -> None:
        """Print a line of its own (an event, a warning) without mangling the progress line on a terminal."""
        if self.tty and self._shown:
            self.stream.write("\r" + CLEAR_EOL)
        self.stream.write(text.rstrip("\n") + "\n")
        if self.tty and self._shown:
            self._write_tty()
        self._flush()

    # ------------------------------------------------------------------------------------------------ numbers

    def steps_per_s(self) -> float | None:
        if len(self._window) < 2:
            return None
        (t0, s0, _), (t1, s1, _) = self._window[0], self._window[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def samples_per_s(self) -> float | None:
        sps = self.steps_per_s()
        return sps * self.global_batch if sps is not None else None

    def tokens_per_s(self) -> float | None:
        pts = [(t, k) for t, _, k in self._window if k is not None]
        if len(pts) < 2:
            return None
        (t0, k0), (t1, k1) = pts[0], pts[-1]
        return (k1 - k0) / (t1 - t0) if t1 > t0 and k1 >= k0 else None

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def eta_s(self) -> float | None:
        sps = self.steps_per_s()
        if sps is None or self.total is None or self.step is None:
            return None
        return max(self.total - self.step, 0) / sps

    def line(self) -> str:
        """The progress line's text (no control characters)."""
        if self.step is None:
            parts = ["waiting for the first step"]
        else:
            pct = f" ({100 * self.step / self.total:.0f}%)" if self.total else ""
            parts = [f"step {self.step}/{self.total or '?'}{pct}"]
            if self.loss is not None:
                parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval_loss {self.eval_loss:.4f}")
        sps, tps = self.samples_per_s(), self.tokens_per_s()
        parts.append(f"{format_rate(sps)} samples/s" if sps is not None else "-- samples/s")
        parts.append(f"{format_rate(tps)} tokens/s" if tps is not None else "-- tokens/s")
        parts.append(f"elapsed {format_duration(self.elapsed_s())}")
        parts.append(f"ETA {format_duration(self.eta_s())}")
        return "  ".join(parts)

    # ------------------------------------------------------------------------------------------------ output

    def _render(self, *, force: bool) -> None:
        if self.tty:
            self._write_tty()
            self._shown = True
        else:
            now = self.clock()
            if force or self._last_print is None or now - self._last_print >= self.interval_s:
                self._write_plain()
                self._last_print = now
            else:
                self._shown = False  # the latest state is not printed yet: finish() prints it
        self._flush()

    def _write_tty(self) -> None:
        width = self._width()
        text = self.line()
        if width and len(text) >= width:
            text = text[: max(width - 1, 0)]  # never wrap: a wrapped line cannot be rewritten with \r
        self.stream.write("\r" + text + CLEAR_EOL)

    def _write_plain(self) -> None:
        self.stream.write(f"progress: {self.line()}\n")
        self._shown = True

    def _width(self) -> int | None:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or None
        except (AttributeError, ValueError, OSError):
            return shutil.get_terminal_size((0, 0)).columns or None

    def _flush(self) -> None:
        try:
            self.stream.flush()
        except (AttributeError, ValueError, OSError):
            pass


class MetricsTail:
    """The new complete lines of ``metrics.jsonl`` since the last poll, as dicts (a half-written last line waits
    for the next poll; a line that is not a JSON object is skipped). ``from_end``: skip what earlier launches of
    the same run directory wrote."""

    def __init__(self, path: str | os.PathLike[str], *, from_end: bool = True):
        self.path = Path(path)
        self.offset = 0
        if from_end:
            try:
                self.offset = self.path.stat().st_size
            except OSError:
                self.offset = 0

    def poll(self) -> list[MetricsRecord]:
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self.offset:  # replaced or truncated: start over
                    self.offset = 0
                fh.seek(self.offset)
                blob = fh.read()
        except OSError:
            return []
        end = blob.rfind(b"\n") + 1
        self.offset += end
        out: list[MetricsRecord] = []
        for line in blob[:end].splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(cast("MetricsRecord", obj))
        return out
