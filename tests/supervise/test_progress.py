"""The progress line of ftkit launch: rewritten in place on a real pseudo-terminal, plain periodic lines on a pipe."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import termios

import pytest

from ftkit.supervise.progress import CLEAR_EOL, MetricsTail, Progress, format_duration, format_rate


class FakeClock:
    """The supervisor's clock (elapsed time, the plain-line interval); the records carry rank 0's own times."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def steps(first: int, last: int, *, t0: float = 5000.0, step_s: float = 0.5, tokens_per_step: int = 256, attempt=0):
    """metrics.jsonl records as rank 0 writes them: one per logged step, 2 steps/s, 256 tokens per step."""
    return [
        {
            "step": s,
            "loss": 3.0 - s / 100,
            "lr": 1e-4,
            "grad_norm": 1.0,
            "attempt": attempt,
            "time": t0 + s * step_s,
            "tokens_seen": s * tokens_per_step,
        }
        for s in range(first, last + 1)
    ]


def _read_all(fd: int) -> str:
    out = b""
    os.set_blocking(fd, False)
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        except OSError:  # EIO once the slave side is closed
            break
        if not chunk:
            break
        out += chunk
    return out.decode()


@pytest.fixture
def terminal():
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))  # 24 rows, 200 columns
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.ONLCR  # the bytes as written: no \n -> \r\n translation by the line discipline
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    stream = os.fdopen(slave, "w", encoding="utf-8", buffering=1)
    yield master, stream
    stream.close()
    os.close(master)


def test_on_a_terminal_the_line_is_rewritten_in_place_with_rates_and_eta(terminal):
    master, stream = terminal
    clock = FakeClock()
    p = Progress(total_steps=100, global_batch=8, stream=stream, clock=clock)
    assert p.tty, "a pseudo-terminal is a terminal"
    for rec in steps(1, 20):
        clock.t += 0.5
        p.update(rec)
    p.update({"step": 20, "eval_loss": 2.5, "attempt": 0, "time": 5010.0})
    p.update({"event": "commit", "step": 20, "commit_s": 0.2, "attempt": 0, "time": 5010.1})  # ignored
    p.finish()
    out = _read_all(master)
    frames = out.split("\r")[1:]
    assert len(frames) == 22, out  # one rewrite per step, one for the evaluation, a last one at finish()
    assert all(f.endswith(CLEAR_EOL) for f in frames[:-1]) and frames[-1].endswith(CLEAR_EOL + "\n")
    assert "\n" not in "".join(frames[:-1])
    last = frames[-1]
    # 2 steps/s x 8 samples = 16 samples/s; 256 tokens per step x 2 steps/s = 512 tokens/s; 80 steps left at 2/s
    assert "step 20/100 (20%)" in last and "loss 2.8000" in last and "eval_loss 2.5000" in last
    assert "16 samples/s" in last and "512 tokens/s" in last
    assert "elapsed 0:00:10" in last and "ETA 0:00:40" in last
    assert "-- samples/s" in frames[0] and "ETA --" in frames[0]  # one logged step: no rate yet


def test_terminal_line_never_wraps(terminal):
    master, stream = terminal
    fcntl.ioctl(stream.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", 24, 40, 0, 0))
    p = Progress(total_steps=100, global_batch=8, stream=stream, clock=FakeClock())
    for rec in steps(1, 3):
        p.update(rec)
    p.message("ftkit: restart 1/3: rank 1 exited -9")
    p.finish()
    out = _read_all(master)
    for frame in out.split("\r"):
        text = frame.replace(CLEAR_EOL, "").rstrip("\n")
        assert len(text) < 40, repr(frame)
    # the message got its own line: the progress line was cleared first and redrawn after it
    assert "\r" + CLEAR_EOL + "ftkit: restart 1/3: rank 1 exited -9\n\rstep 3/100" in out


def test_on_a_pipe_plain_lines_every_interval_and_the_last_state_at_the_end():
    r, w = os.pipe()
    stream = os.fdopen(w, "w", encoding="utf-8")
    clock = FakeClock()
    p = Progress(total_steps=100, global_batch=8, stream=stream, clock=clock, interval_s=30)
    assert not p.tty
    for rec in steps(1, 90):  # 90 steps, 1 s of the supervisor's clock each
        clock.t += 1
        p.update(rec)
    p.finish()
    stream.close()
    out = _read_all(r)
    os.close(r)
    lines = out.splitlines()
    assert "\r" not in out and "\x1b" not in out
    assert all(line.startswith("progress: step ") for line in lines)
    # step 1 at once, then every 30 s of the supervisor's clock (steps 31 and 61), then step 90 at the end
    assert [line.split()[2] for line in lines] == ["1/100", "31/100", "61/100", "90/100"]
    assert "16 samples/s" in lines[-1] and "512 tokens/s" in lines[-1] and "ETA 0:00:05" in lines[-1]
    assert "elapsed 0:01:30" in lines[-1]


def test_a_restart_starts_a_new_rate_window():
    r, w = os.pipe()
    stream = os.fdopen(w, "w", encoding="utf-8")
    p = Progress(total_steps=100, global_batch=4, stream=stream, clock=FakeClock(), interval_s=0)
    for rec in steps(1, 10):
        p.update(rec)
    assert p.samples_per_s() == pytest.approx(8.0)
    # attempt 1 resumes from step 5 after 10 minutes: its first record must not turn the gap into a rate
    p.update(steps(6, 6, t0=6000.0, step_s=1.0, attempt=1)[0])
    assert p.samples_per_s() is None and p.eta_s() is None
    for rec in steps(7, 9, t0=6000.0, step_s=1.0, attempt=1):
        p.update(rec)
    assert p.samples_per_s() == pytest.approx(4.0)
    p.finish()
    stream.close()
    os.close(r)


def test_metrics_tail_reads_only_new_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")  # an earlier launch of this run directory
    tail = MetricsTail(path)
    assert tail.poll() == []
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 2, "loss": 1.0}) + "\nnot json\n" + '{"step": 3, "lo')
    assert tail.poll() == [{"step": 2, "loss": 1.0}]
    with open(path, "a") as fh:
        fh.write('ss": 0.5}\n')
    assert tail.poll() == [{"step": 3, "loss": 0.5}]
    assert MetricsTail(tmp_path / "absent.jsonl").poll() == []
    assert [r["step"] for r in MetricsTail(path, from_end=False).poll()] == [1, 2, 3]


def test_formats():
    assert format_duration(None) == "--" and format_duration(3725) == "1:02:05"
    assert format_duration(90061) == "1d 1:01:01"
    assert [format_rate(x) for x in (0.5123, 9.6, 245.0, 12345.0, 1.05e6)] == ["0.512", "9.6", "245", "12.3k", "1.05M"]
