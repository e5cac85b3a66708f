"""wandb and mlflow through HF's own integration callbacks: one tracker run across restarts, each step's values on it
once, and each attempt (restart, resume, shrink) recorded on the run.

What a resumed attempt recomputes is logged only where the tracker lacks it; what a killed attempt's tracker lost is
logged again from metrics.jsonl. Which steps a tracker holds is read from the tracker itself: mlflow's metric
history, wandb's run summary online, and offline the ``.wandb`` files earlier attempts left on disk (a killed
attempt's wandb-core, in its own session, may or may not have written its records before it noticed its rank died).
"""

from __future__ import annotations

import os
import struct
import sys
import time
import types
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ftkit.cluster.procs import is_alive
from ftkit.rundir.layout import atomic_write, read_jsonl

if TYPE_CHECKING:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

    from ftkit.rundir.layout import RunDir
    from ftkit.rundir.records import JSONObject

TRACKERS_FILE = "trackers.json"  # in RUN/ftkit/: the tracker runs' ids, so every attempt continues the same run
_TRACKER_OF = {"WandbCallback": "wandb", "MLflowCallback": "mlflow"}  # HF's integration callback -> tracker


class Trackers:
    """Per rank: the tracker runs' ids (wandb's derived from the run directory, mlflow's as its first attempt created
    it), and, once the trackers started, which steps each already holds."""

    def __init__(self, rd: RunDir, attempt: int, resume: str | None):
        import hashlib
        import json

        self.rd, self.attempt, self.resume = rd, attempt, resume
        self.path = rd.meta / TRACKERS_FILE
        try:
            ids = json.loads(self.path.read_text())
        except (OSError, ValueError):
            ids = {}
        self.ids: JSONObject = ids if isinstance(ids, dict) else {}
        digest = hashlib.sha1(str(Path(rd.path).resolve()).encode()).hexdigest()
        self.ids.setdefault("wandb_run_id", f"ftkit{digest[:15]}")
        self.held: dict[str, set[int]] = {}  # tracker -> steps it holds (known once the trackers started)

    def environment(self) -> dict[str, str]:
        """Set before any tracker starts (the user's own values win): wandb resumes its run by id; mlflow resumes
        the run an earlier attempt created."""
        env = {"WANDB_RUN_ID": cast(str, self.ids["wandb_run_id"]), "WANDB_RESUME": "allow"}
        if self.ids.get("mlflow_run_id"):
            env["MLFLOW_RUN_ID"] = str(self.ids["mlflow_run_id"])
        return env

    def skip(self, tracker: str | None, step: int) -> bool:
        return tracker is not None and step in self.held.get(tracker, set())

    def start_attempt(self, rank: int, step: int) -> None:
        """Rank 0, once the trackers started (on_train_begin): record this attempt on each tracker run, find which
        steps each holds, and give it the logged steps it lacks up to the step this attempt resumes at (a killed
        attempt's wandb-core, for one, may have ended without writing what it was sent)."""
        if rank != 0:
            return
        import json

        start = f"resumed at step {step} ({self._why()})" if self.resume else "fresh start"
        line = f"attempt {self.attempt}: {start}"
        history = _logged_history(self.rd.metrics, self.attempt)
        wandb = sys.modules.get("wandb")
        if wandb is not None and getattr(wandb, "run", None) is not None:
            run = wandb.run
            run.summary.update({"ftkit/attempt": self.attempt, "ftkit/last_start": line})
            run.tags = tuple(dict.fromkeys([*run.tags, f"ftkit-attempt-{self.attempt}"]))
            if run.offline:  # what earlier attempts' offline runs hold on disk, whether they finished or were killed
                held = offline_steps(Path(run.settings.sync_dir), str(run.id))
            else:
                last = run.summary.get("train/global_step")
                held = set(range(1, int(last) + 1)) if isinstance(last, (int, float)) else set()
            self.held["wandb"] = held
            for s in sorted(set(history) - held):
                if s <= step:
                    values = history[s][0]
                    run.log({**{f"train/{k}": v for k, v in values.items()}, "train/global_step": s})
                    held.add(s)
        mlflow = sys.modules.get("mlflow")
        if mlflow is not None and mlflow.active_run() is not None:
            run_id = mlflow.active_run().info.run_id
            mlflow.set_tag(f"ftkit.supervise.attempt.{self.attempt}", line)
            self.ids.setdefault("mlflow_run_id", run_id)
            client = mlflow.tracking.MlflowClient()
            held = {int(m.step) for m in client.get_metric_history(run_id, "loss")}
            self.held["mlflow"] = held
            for s in sorted(set(history) - held):
                if s <= step:
                    mlflow.log_metrics(history[s][0], step=s)
                    held.add(s)

        atomic_write(self.path, json.dumps(self.ids, indent=1))

    def _why(self) -> str:
        """The supervisor's reason for this attempt: its last failure, shrink or stop in events.jsonl."""
        why = "relaunched"
        for e in _read_jsonl(self.rd.events):
            if e.get("event") in ("failure", "shrink", "stopped", "orphan_stopped") and e.get("message"):
                why = str(e["message"])[:300]
        return why


def _read_jsonl(path: Path) -> list[JSONObject]:
    try:
        return read_jsonl(path)
    except OSError:
        return []


def _logged_history(metrics: Path, attempt: int) -> dict[int, tuple[dict[str, float], int]]:
    """step -> (values in HF's names, attempt) as earlier attempts logged them (the newest attempt's wins)."""
    out: dict[int, tuple[dict[str, float], int]] = {}
    names = {"loss": "loss", "grad_norm": "grad_norm", "lr": "learning_rate"}
    for m in _read_jsonl(metrics):
        step, a = m.get("step"), m.get("attempt")
        if "loss" in m and isinstance(step, int) and isinstance(a, int) and a != attempt:
            values = {names[k]: float(cast(float, m[k])) for k in names if isinstance(m.get(k), (int, float))}
            out[step] = (values, a)
    return out


def offline_steps(own: Path, run_id: str, wait_s: float = 30.0) -> set[int]:
    """The steps whose loss the earlier attempts' offline runs of RUN_ID hold on disk: every ``offline-run-*``
    directory beside OWN (this attempt's) with a ``run-RUN_ID.wandb`` (``wandb sync`` uploads them all to one run).

    A killed attempt's wandb-core, in a session of its own, outlives the supervisor's teardown and may still be
    writing: it is given WAIT_S to end (it ends once it notices its rank died), then killed, so what is on disk is
    final before it is read. A file cut short holds the records before the cut."""
    _end_orphaned_writers(run_id, wait_s)
    held: set[int] = set()
    for path in sorted(own.parent.glob(f"offline-run-*/run-{run_id}.wandb")):
        if path.parent == own:
            continue
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {(i.key or "/".join(i.nested_key)): i.value_json for i in record.history.item}
            step = _number(row.get("train/global_step"))
            if "train/loss" in row and step is not None:
                held.add(int(step))
    return held


def _number(text: str | None) -> float | None:
    import json

    try:
        value = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _end_orphaned_writers(run_id: str, wait_s: float) -> None:
    """Wait up to WAIT_S for every wandb-core of RUN_ID whose rank (its ``--pid``) is gone to end, then SIGKILL the
    ones left. Only this user's processes are seen (another user's /proc/PID/environ is unreadable)."""
    import signal

    marker = f"WANDB_RUN_ID={run_id}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        orphans = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if not argv or Path(argv[0].decode(errors="replace")).name != "wandb-core" or b"--pid" not in argv:
                    continue
                parent = int(argv[argv.index(b"--pid") + 1])
                # is_alive counts a zombie rank as gone
                if marker in (entry / "environ").read_bytes().split(b"\0") and not is_alive(parent):
                    orphans.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
        if not orphans:
            return
        if time.monotonic() >= deadline:
            for pid in orphans:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.2)
            return
        time.sleep(0.2)


def wandb_records(path: Path) -> Iterator[Any]:  # wandb's Record: protobuf makes the class at import
    """The records of a ``.wandb`` file as wandb's own protobuf ``Record``s. The file is LevelDB's log format after
    wandb's 7-byte header: 32 KiB blocks of chunks (FULL, or FIRST/MIDDLE/LAST pieces of one record), each with a
    CRC-32 of its type byte and payload, a length and a type. Reading stops at the first chunk cut short or with a
    wrong checksum (a writer killed mid-block). wandb 0.31 ships no Python reader of its own."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    try:
        data = path.read_bytes()
    except OSError:
        return
    if data[:4] != b":W&B":
        return
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header: padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zeros: the rest of the block is padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length or zlib.crc32(bytes([kind]) + chunk) != crc:
            return
        pos += 7 + length
        if kind == 2:  # FIRST
            pending = chunk
            continue
        if kind == 3:  # MIDDLE
            pending += chunk
            continue
        record = pb.Record()  # type: ignore[attr-defined]  # protobuf generates its classes at import
        try:
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
        except DecodeError:
            return
        pending = b""
        yield record


def guard_trackers(trackers: Trackers) -> Callable[[types.ModuleType], None]:
    """A patch for ``transformers.integrations.integration_utils``: wandb's and mlflow's ``on_log`` skip a step
    their run already holds (a resumed attempt recomputes steps an earlier attempt logged)."""
    import functools

    def patch(mod: types.ModuleType) -> None:
        def make(original: Callable[..., None], tracker: str) -> Callable[..., None]:
            @functools.wraps(original)
            def guarded(
                self: TrainerCallback,
                args: TrainingArguments,
                state: TrainerState,
                control: TrainerControl,
                *a: Any,
                **kw: Any,
            ) -> None:
                if trackers.skip(tracker, state.global_step):
                    return None
                return original(self, args, state, control, *a, **kw)

            guarded._ftkit = True  # type: ignore[attr-defined]
            return guarded

        for name, tracker in _TRACKER_OF.items():
            cls = getattr(mod, name, None)
            original = cls.__dict__.get("on_log") if cls is not None else None
            if cls is not None and original is not None and not getattr(original, "_ftkit", False):
                cls.on_log = make(original, tracker)

    return patch


def atomic_mlflow_run_info(mod: types.ModuleType) -> None:
    """A patch for ``mlflow.store.tracking.file_store``: its ``write_yaml`` rewrites a run's ``meta.yaml`` in place
    (open for writing, then dump), so a rank killed between the two leaves it empty, and every later attempt that
    resumes the run fails reading it (``'NoneType' object has no attribute 'copy'``): the supervisor's teardown of a
    failed attempt lands there when mlflow's exit handler ends the run. A rewrite goes through a temporary file beside
    it and a rename; a new file is written as mlflow writes it."""
    original = mod.write_yaml
    if getattr(original, "_ftkit", False):
        return

    def write_yaml(
        root: str,
        file_name: str,
        data: object,
        overwrite: bool = False,
        sort_keys: bool = True,
        ensure_yaml_extension: bool = True,
    ) -> None:
        path = Path(root) / file_name
        if ensure_yaml_extension and path.suffix != ".yaml":
            path = path.with_name(path.name + ".yaml")
        if not (overwrite and path.is_file()):
            return original(root, file_name, data, overwrite, sort_keys, ensure_yaml_extension)
        import yaml
        from mlflow.utils.yaml_utils import YamlSafeDumper

        text = yaml.dump(data, default_flow_style=False, allow_unicode=True, sort_keys=sort_keys, Dumper=YamlSafeDumper)
        atomic_write(path, text)

    write_yaml._ftkit = True  # type: ignore[attr-defined]
    vars(mod)["write_yaml"] = write_yaml  # the module's attribute
