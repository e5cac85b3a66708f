"""The run directory's layout, shared by the supervisor (head node) and the training entry (every rank).

``train.output_dir`` holds everything a run produces::

    checkpoint-N/                 HF Trainer checkpoints; ftkit_commit.json inside once committed
    final/                        the final model (HF format; adapters for LoRA), committed like a checkpoint
    events.jsonl                  every supervisor decision, one JSON object per line
    metrics.jsonl                 rank 0: step, loss, learning rate, time, attempt (one line per logged step)
    logs/attempt-N/rank-R.log     one log per rank per attempt; launcher.log is the engine's own output
    ftkit/spec.json               what every rank needs: resolved typed values, plan, TrainingArguments
    ftkit/recipe.json             the resolved recipe (provenance: the model card, calibration; no rank reads it)
    ftkit/ds_config.json          rendered configs used by this run
    ftkit/accelerate.yaml
    ftkit/heartbeat/rank-R.json   rewritten every step: progress the supervisor can see
    ftkit/attempts/N/pids/rank-R.json   host, pid and parent pid of each rank, for teardown by pid
    ftkit/attempts/N/errors/rank-R.json user errors a rank reported (not worth a restart)
    ftkit/batons/PID-INODE.json   a torch build lock a rank holds right now (ftkit.rundir.batons)

Writes that others read while they change use :func:`atomic_write` (temp file, fsync, rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast, overload

if TYPE_CHECKING:
    from ftkit.rundir.records import AgentRecord, ErrorRecord, Event, Heartbeat, JSONObject, MetricsRecord, PidRecord

NEARLY_FULL = 16 * 1024 * 1024  # free bytes below which a failed write is taken for a full disk
STOP_FILE = "stop.json"  # in RUN/ftkit/: the supervisor's save-and-stop request to every rank of an attempt


class RunDir:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    @property
    def meta(self) -> Path:
        return self.path / "ftkit"

    @property
    def spec(self) -> Path:
        return self.meta / "spec.json"

    @property
    def recipe(self) -> Path:
        return self.meta / "recipe.json"

    @property
    def ds_config(self) -> Path:
        return self.meta / "ds_config.json"

    @property
    def accelerate_config(self) -> Path:
        return self.meta / "accelerate.yaml"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def final(self) -> Path:
        return self.path / "final"

    @property
    def batons(self) -> Path:
        return self.meta / "batons"

    @property
    def heartbeat_dir(self) -> Path:
        return self.meta / "heartbeat"

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeat_dir / f"rank-{rank}.json"

    def log_dir(self, attempt: int) -> Path:
        return self.path / "logs" / f"attempt-{attempt}"

    def rank_log(self, attempt: int, rank: int) -> Path:
        return self.log_dir(attempt) / f"rank-{rank}.log"

    def attempt_dir(self, attempt: int) -> Path:
        return self.meta / "attempts" / str(attempt)

    def pid_file(self, attempt: int, rank: int) -> Path:
        return self.attempt_dir(attempt) / "pids" / f"rank-{rank}.json"

    def error_file(self, attempt: int, rank: int) -> Path:
        return self.attempt_dir(attempt) / "errors" / f"rank-{rank}.json"

    def next_attempt(self) -> int:
        """Attempts are numbered across launches of the same run directory, so logs and records never mix."""
        base = self.meta / "attempts"
        nums = [int(p.name) for p in base.iterdir() if p.name.isdigit()] if base.is_dir() else []
        logs = self.path / "logs"
        if logs.is_dir():
            nums += [int(p.name.split("-")[1]) for p in logs.glob("attempt-*") if p.name.split("-")[1].isdigit()]
        return max(nums) + 1 if nums else 0

    def read_spec(self) -> JSONObject:
        spec = json.loads(self.spec.read_text())
        if not isinstance(spec, dict):
            raise ValueError(f"{self.spec}: not a JSON object")
        return spec

    def heartbeats(self) -> list[Heartbeat]:
        """Every rank's latest heartbeat (``ftkit/heartbeat/rank-R.json``), read once per supervisor poll.

        A file whose (inode, size, mtime, ctime) did not change since this RunDir's previous call is not read
        again: ranks replace their heartbeat by rename (a new inode every time), so any rewrite shows, and 1,024
        unchanged files cost 1,024 stats instead of 1,024 reads and parses (benchmarks/heartbeat_poll.py). The
        timestamps are only compared with themselves, never with a clock: the supervisor times changes on its
        own monotonic clock, as file times from other hosts (or an NFS server) cannot be trusted.
        """
        cache: dict[str, tuple[tuple[int, ...], Heartbeat]] = getattr(self, "_heartbeat_cache", {})
        seen: dict[str, tuple[tuple[int, ...], Heartbeat]] = {}
        out: list[Heartbeat] = []
        try:
            with os.scandir(self.heartbeat_dir) as it:
                entries = sorted(
                    (e for e in it if e.name.startswith("rank-") and e.name.endswith(".json")), key=lambda e: e.name
                )
        except OSError:  # no heartbeat yet (or not a directory)
            return out
        for e in entries:
            try:
                st = e.stat()
                key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                hit = cache.get(e.name)
                rec = hit[1] if hit is not None and hit[0] == key else json.loads(_read_bytes(e.path))
            except (OSError, ValueError):
                continue  # being replaced right now; the next poll reads it
            if not isinstance(rec, dict):
                continue
            beat = cast("Heartbeat", rec)
            seen[e.name] = (key, beat)
            out.append(cast("Heartbeat", dict(beat)))  # a copy: a caller changing it must not change the cache
        self._heartbeat_cache = seen
        return out

    @overload
    def records(self, kind: Literal["pids"], attempt: int) -> list[PidRecord]: ...
    @overload
    def records(self, kind: Literal["errors"], attempt: int) -> list[ErrorRecord]: ...
    @overload
    def records(self, kind: Literal["agents"], attempt: int) -> list[AgentRecord]: ...

    def records(self, kind: str, attempt: int) -> list[PidRecord] | list[ErrorRecord] | list[AgentRecord]:
        """The pid or error records of one attempt (kind: 'pids' or 'errors'), or its nodes' checkpoint agents
        ('agents': ``agent-<host>.json``, :mod:`ftkit.launch.tier`); a file that is not a JSON object is skipped."""
        out: list[JSONObject] = []
        d = self.attempt_dir(attempt) / kind
        if d.is_dir():
            for p in sorted(d.glob("agent-*.json" if kind == "agents" else "rank-*.json")):
                try:
                    rec = json.loads(p.read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
        return cast("list[PidRecord]", out)  # the overloads above say which record kind


def _read_bytes(path: str) -> bytes:
    """A small file's content with bare os.open/os.read: a third of the cost of ``Path.read_text`` (no text layer),
    which matters 1,024 times per supervisor poll."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def atomic_write(
    path: Path, data: str | bytes, *, fsync: bool = True, sync_dir: bool = False, mode: int | None = None
) -> None:
    """Replace ``path`` in one step: readers see the old or the new content, never a torn one. The one way ftkit
    writes a file others read while it changes (heartbeats, records, commit records).

    ``fsync``: the data is on stable storage before the rename; ``sync_dir``: the rename is too (fsync of the
    directory), for a record that must survive a crash of the machine (a commit record). The temp file is
    ``.<name>.tmp-*`` beside it. The file gets the mode a plain ``open()`` would give it (0666 less the umask;
    mkstemp alone makes 0600). On any error the temp file is removed; an OSError from writing or renaming names
    ``path`` (not the temp file). ``mode``: the file's mode instead (0o600 for a file only its user may read).
    """
    path.parent.mkdir(parents=True, exist_ok=True)  # an error here names the directory that could not be made
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), creation_mode() if mode is None else mode)
            fh.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if sync_dir:
            _fsync_dir(path.parent)
    except OSError as e:
        _unlink_quietly(tmp)
        if e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on a directory: nothing more to do there
        if e.errno not in (22, 9):  # EINVAL, EBADF
            raise
    finally:
        os.close(fd)


def _unlink_quietly(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def creation_mode() -> int:
    """0666 less this process's umask: the mode ``open(path, "w")`` gives a new file."""
    try:  # Linux >= 4.7 shows it without changing it (os.umask can only be read by setting it)
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def append_jsonl(path: Path, record: Mapping[str, object]) -> None:
    """Append one JSON line; a single write() of a short line is atomic enough for a log read by humans and tools."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()


def tensorboard_dir(output_dir: str | Path) -> str:
    """Where TensorBoard event files go when train.report_to has tensorboard: ``<output_dir>/tensorboard``, handed to
    the ranks as the ``TENSORBOARD_LOGGING_DIR`` environment variable (transformers 5.x reads only that)."""
    return str(Path(output_dir) / "tensorboard")


def read_jsonl(path: Path, skipped: dict[str, int] | None = None) -> list[JSONObject]:
    """The JSON objects of a .jsonl file (events, metrics), in order; [] when it does not exist. Other lines (one cut
    by a crash, one that is not an object) are skipped and counted in ``skipped[path.name]``. Other OS errors
    propagate (each command says them its own way)."""
    return list(iter_jsonl(path, skipped))


def iter_jsonl(path: Path, skipped: dict[str, int] | None = None) -> Iterator[JSONObject]:
    """:func:`read_jsonl` one object at a time, for a reader that keeps only what it needs of a long file (a
    million-step run's metrics.jsonl is GBs as dicts); ``skipped`` is counted as the lines are read."""
    try:
        fh = open(path, encoding="utf-8", errors="replace")  # closed below, also when the reader stops early
    except FileNotFoundError:
        return
    with fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                yield obj
            elif skipped is not None:
                skipped[path.name] = skipped.get(path.name, 0) + 1


def read_events(path: Path, skipped: dict[str, int] | None = None) -> list[Event]:
    """``events.jsonl`` as :class:`Event` records (:func:`read_jsonl`)."""
    return cast("list[Event]", read_jsonl(path, skipped))


def read_metrics(path: Path, skipped: dict[str, int] | None = None) -> list[MetricsRecord]:
    """``metrics.jsonl`` as :class:`MetricsRecord` records (:func:`read_jsonl`)."""
    return cast("list[MetricsRecord]", read_jsonl(path, skipped))


def iter_metrics(path: Path, skipped: dict[str, int] | None = None) -> Iterator[MetricsRecord]:
    """``metrics.jsonl`` one :class:`MetricsRecord` at a time (:func:`iter_jsonl`)."""
    return cast("Iterator[MetricsRecord]", iter_jsonl(path, skipped))
