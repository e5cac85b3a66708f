"""One rank of a run: who it is, what it writes for the supervisor, and the requests it answers (:mod:`ftkit.hf`).

* :class:`RankContext`: rank, local rank, node, and the records the supervisor reads: heartbeat
  (``ftkit/heartbeat/rank-R.json``), pid record (teardown by pid), error record (a failure a restart cannot fix);
* :class:`StopRequest`: the graceful stop, agreed by every rank at the same optimizer step;
* :class:`Fault`: test-only fault injection at a chosen step.

Standard library only at import time (torch inside the functions that need it).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ftkit.cluster.procs import proc_start_time
from ftkit.errors import FsdpNotOn, FtkitError
from ftkit.rundir.batons import forget as forget_baton
from ftkit.rundir.batons import record as record_baton
from ftkit.rundir.batons import release_dead
from ftkit.rundir.env import ENV_ALLOW, NODE_ENV, PACE_ENV, SECRET, ftkit_cache
from ftkit.rundir.layout import STOP_FILE, RunDir, atomic_write
from ftkit.rundir.spec import RunSpec

if TYPE_CHECKING:
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from torch.utils.file_baton import FileBaton
    from transformers import Trainer, TrainingArguments

    from ftkit.rundir.records import ErrorRecord, Heartbeat, PidRecord


def _env_int(*names: str, default: int = 0) -> int:
    for n in names:
        if os.environ.get(n, "") != "":
            return int(os.environ[n])
    return default


class RankContext:
    """Who this rank is and where its run lives; writes its heartbeat, pid and error records."""

    def __init__(self, run_dir: Path, attempt: int, spec: RunSpec | None = None):
        self.rd = RunDir(run_dir)
        self.attempt = attempt
        self.rank = _env_int("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
        self.local_rank = _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
        self.world_size = _env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", default=1)
        self.host = socket.gethostname()
        # The node's name as the hostfile (and so ssh) knows it: teardown reaches this rank through that name.
        # ftkit sets FTKIT_NODE per node for torchrun/accelerate (c10d numbers nodes by arrival, not hostfile
        # order); DeepSpeed's launcher passes the hostfile index as CROSS_RANK.
        self.node_rank = _env_int("CROSS_RANK", "GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
        self.node_host = os.environ.get(NODE_ENV, "")
        if not self.node_host:
            self.node_host = "localhost"
            hosts = spec.hosts if spec is not None else []
            if 0 <= self.node_rank < len(hosts):
                self.node_host = cast(str, hosts[self.node_rank][0])  # [host, slots]
        self.last_loss: float | None = None
        self.compute_ewma_s: float | None = None
        self.compute_n = 0
        # How the supervisor can watch this rank: the import hook serves it, an HF Trainer was built (ftkit's
        # callbacks), or the loop calls ftkit.hf.step(). A hooked rank with neither cannot be watched step by step.
        self.hooked = False
        self.trainer_built = False
        self.loop_api = False
        self.started_at_step: int | None = None  # the global step training began at in this attempt (resume proof)
        self.committed: int | None = None  # the newest step committed in this attempt (heartbeats carry it)
        self.sharding: dict[str, int] | None = None  # FSDP2: DTensor parameters of all (ftkit.launch.rank.fsdp2_proof)

    def heartbeat(self, phase: str, step: int | None = None, committed: int | None = None) -> None:
        """Rewrite this rank's heartbeat. COMMITTED: a step this rank just saw committed (every later beat carries
        the newest)."""
        if phase == "train":
            resume_full_collections()
        rec: Heartbeat = {
            "rank": self.rank,
            "attempt": self.attempt,
            "phase": phase,
            "step": step,
            "loss": self.last_loss,
            "time": time.time(),
            "pid": os.getpid(),
            "host": self.host,
            "node": self.node_host,
            "compute_ewma_s": self.compute_ewma_s,
            "compute_n": self.compute_n,
            "hooked": self.hooked,
            "trainer": self.trainer_built,
            "loop": self.loop_api,
            "started_at_step": self.started_at_step,
        }
        if self.sharding is not None:
            rec["sharding"] = self.sharding
        if committed is not None:
            self.committed = committed
        rec["committed"] = self.committed  # the newest step this rank saw committed (any tier): in every heartbeat
        atomic_write(self.rd.heartbeat(self.rank), json.dumps(rec), fsync=False)

    def record_pid(self, watchdog: dict[str, float] | None = None) -> None:
        """pid, start time, parent (the per-node agent) and the node's hostfile name: teardown works from this.
        The allow-listed environment (secrets left out) shows what really reached this rank. ``watchdog``: the
        bounds of this rank's supervisor watchdog (it stops itself when its supervisor is gone)."""
        import fnmatch

        pid, ppid = os.getpid(), os.getppid()
        env = {
            k: v
            for k, v in sorted(os.environ.items())
            if any(fnmatch.fnmatchcase(k, pat) for pat in ENV_ALLOW) and not SECRET.search(k) and k != "PATH"
        }
        rec: PidRecord = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node_rank": self.node_rank,
            "host": self.node_host,
            "hostname": self.host,
            "pid": pid,
            "start_time": proc_start_time(pid),
            "ppid": ppid,
            "ppid_start_time": proc_start_time(ppid),
            "pgid": os.getpgid(0),
            "attempt": self.attempt,
            "time": time.time(),
            "env": env,
            "env_keys": sorted(os.environ),
            # DeepSpeed's CPU collectives name their /dev/shm buffers after these; teardown removes them.
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": os.environ.get("MASTER_PORT"),
            "watchdog": watchdog,
        }
        atomic_write(self.rd.pid_file(self.attempt, self.rank), json.dumps(rec), fsync=False)

    def record_error(
        self,
        err: FtkitError,
        step: int | None = None,
        repeats: bool = False,
        traceback: list[str] | None = None,
        failure_class: str | None = None,
        restartable: bool | None = None,
        summary: str | None = None,
    ) -> None:
        """Report a user error to the supervisor. STEP: the step it happened after; REPEATS: a restart would meet
        it again; TRACEBACK: the script's own last lines; FAILURE_CLASS, RESTARTABLE, SUMMARY: why, in
        :mod:`ftkit.rundir.failures`' words, and the exception's own line."""
        rec: ErrorRecord = {
            "rank": self.rank,
            "host": self.host,
            "kind": type(err).__name__,
            "lines": err.lines(),
            "exit_code": err.exit_code,
        }
        rec["step"] = step  # None: before the first step (or not known)
        if repeats:
            rec["repeats"] = repeats
        if traceback is not None:
            rec["traceback"] = traceback
        if failure_class is not None:
            rec["failure_class"] = failure_class
        if restartable is not None:
            rec["restartable"] = restartable
        if summary is not None:
            rec["summary"] = summary
        atomic_write(self.rd.error_file(self.attempt, self.rank), json.dumps(rec))


class StopRequest:
    """Save-and-stop: requested by the supervisor (``ftkit/stop.json`` of this attempt) or by this rank's watchdog
    (its supervisor is gone). :meth:`agreed` is called by every rank at every optimizer-step end and all-reduces the
    local answer (max), so every rank sees the request at the same step, or none does."""

    def __init__(self, rd: RunDir, attempt: int):
        self.path = rd.meta / STOP_FILE
        self.attempt = attempt
        self.local = threading.Event()
        self.stopped_at: int | None = None
        self.finished = threading.Event()

    def requested_here(self) -> bool:
        if self.local.is_set():
            return True
        if not self.path.exists():  # one stat per step in the common case
            return False
        try:
            rec = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(rec, dict) and rec.get("attempt") == self.attempt

    def timeout_s(self, default: float = 300.0) -> float:
        """How long the supervisor waits for this stop (its request says), ``default`` when it cannot be read."""
        try:
            rec = json.loads(self.path.read_text())
            return float(rec.get("timeout_s") or default)
        except (OSError, ValueError, TypeError, AttributeError):
            return default

    def agreed(self, device: torch.device | None = None) -> bool:
        flag = 1 if self.requested_here() else 0
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            t = torch.tensor([flag], dtype=torch.int32, device=device if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        return bool(flag)


def _redirect_output(path: Path) -> None:
    """Send this process's stdout/stderr (including C-level writes from torch/deepspeed) to its own log file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


# ------------------------------------------------------------------------------------------------ post-import hooks


class PostImportHook(importlib.abc.MetaPathFinder):
    """Runs ``patches[name]`` right after module ``name`` executed, whoever imports it and however (``transformers``
    loads its submodules lazily), and executes it with the modules of ``hidden[name]`` absent (:func:`leave_out`
    for that one execution). The module's own loader stays in place (``inspect`` and ``linecache`` keep finding its
    source); only that loader's ``exec_module`` is wrapped for this one import. One instance per process
    (:func:`on_import` and :func:`hide_while_importing` register with it)."""

    def __init__(self) -> None:
        self.patches: dict[str, list[Callable[[types.ModuleType], None]]] = {}
        self.hidden: dict[str, tuple[str, ...]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patches = self.patches.get(fullname, [])
        hidden = self.hidden.get(fullname, ())
        if not patches and not hidden:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            marked = leave_out(hidden)
            try:
                original(module)
            finally:
                for n in marked:  # importable again, for everyone else (unless the module imported it after all)
                    if n in sys.modules and sys.modules[n] is None:
                        del sys.modules[n]
                try:
                    del loader.exec_module  # back to the class's method: the wrapper serves this import only
                except AttributeError:
                    pass
            for patch in list(patches):
                patch(module)

        # this loader instance only (the wrapper deletes itself after the import): shadows the class's method
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_HOOK: PostImportHook | None = None


def _hook() -> PostImportHook:
    global _HOOK
    if _HOOK is None:
        _HOOK = PostImportHook()
        sys.meta_path.insert(0, _HOOK)
    return _HOOK


def on_import(name: str, patch: Callable[[types.ModuleType], None]) -> None:
    """``patch(module)`` once module ``name`` is imported (at once when it already is)."""
    _hook().patches.setdefault(name, []).append(patch)
    if name in sys.modules:  # imported before us (another sitecustomize, or the script itself): patch now
        patch(sys.modules[name])


def hide_while_importing(name: str, hidden: Sequence[str]) -> None:
    """Module ``name``, when it is imported, executes as if the modules ``hidden`` (those not imported by then) were
    not installed: an optional ``import`` of one of them in it fails, and it goes without. They are importable again
    as soon as it has executed. Nothing happens when ``name`` is imported already."""
    _hook().hidden[name] = tuple(hidden)


# ------------------------------------------------------------------------------------------------ rank start-up


DEFER_AT_MOST_S = 300.0  # start-up's deferral of full collections ends here at the latest (a loop ftkit never sees)
_startup_thresholds: tuple[int, int, int] | None = None  # the thresholds to restore; None: nothing deferred
_deferred_once = False


def defer_full_collections() -> None:
    """At a rank's start, before the libraries load: collect the oldest generation 1000x less often until training
    begins (:func:`resume_full_collections`: the first training heartbeat, or :data:`DEFER_AT_MOST_S`). Importing
    torch, transformers and DeepSpeed otherwise sets off full collections of an ever larger heap of objects that
    live as long as the process (~0.9 s of every rank's start, ``benchmarks/rank_gc.py``); young cycles are still
    collected as usual. Once per process; a process whose collector is off is left as it is."""
    global _startup_thresholds, _deferred_once
    import gc

    if _deferred_once or not gc.isenabled():
        return
    _deferred_once = True
    _startup_thresholds = gc.get_threshold()
    first, second, third = _startup_thresholds
    gc.set_threshold(first, second, third * 1000)
    timer = threading.Timer(DEFER_AT_MOST_S, resume_full_collections)
    timer.daemon = True
    timer.name = "ftkit-startup-gc"
    timer.start()


def resume_full_collections() -> None:
    """Training began: the collector's own thresholds again (cheap to call at every step)."""
    global _startup_thresholds
    saved, _startup_thresholds = _startup_thresholds, None
    if saved is not None:
        import gc

        gc.set_threshold(*saved)


# Libraries the rank's stack imports only because they are installed, whether or not the run uses them: importing
# DeepSpeed imports mlflow (its autotuner logs there), transformers' Trainer imports datasets (pandas, pyarrow) and
# PEFT (to recognise adapter models). mlflow and datasets together cost every rank ~3.8 CPU-seconds of its start and
# every engine process (DeepSpeed's runner and launcher) the mlflow part; PEFT ~0.3 more in a rank
# (``benchmarks/rank_imports.py``).
OPTIONAL_IMPORTS = ("mlflow", "datasets", "peft")


def leave_out(names: Sequence[str]) -> list[str]:
    """Makes each of ``names`` this process has not imported yet absent from it, as if it were not installed:
    ``import`` raises ImportError and ``importlib.util.find_spec`` finds nothing (Python's own ``None`` entry in
    ``sys.modules``), so a library that imports it only optionally goes without. Call it before the library loads, in
    a process whose own code never imports them (the built-in entry, an engine's launcher). Returns those marked."""
    marked = [n for n in names if n not in sys.modules]
    for n in marked:
        sys.modules[n] = None  # type: ignore[assignment]  # the import system's documented "not importable" mark
    return marked


def unused_imports(report_to: str | Sequence[str] | None, lora: bool) -> list[str]:
    """What :func:`leave_out` may leave out of a rank of the built-in entry that reports to ``report_to`` (the
    TrainingArguments value): datasets always (the entry's rows are lists), mlflow unless the run logs to it, PEFT
    unless the run trains LoRA adapters (``lora``)."""
    wanted = {report_to} if isinstance(report_to, str) else set(report_to or ())
    used = {"peft"} if lora else set()
    return [n for n in OPTIONAL_IMPORTS if n not in used and (n != "mlflow" or not wanted & {n, "all"})]


def skip_final_collection() -> None:
    """At exit, after every other exit handler of the rank (register this first: atexit runs them in reverse):
    ``gc.freeze()``, so Python's last garbage collections at shutdown skip the millions of objects torch,
    transformers and DeepSpeed allocated. Walking them cost a rank ~1.4 s at every exit, a restart's
    teardown included (``benchmarks/rank_gc.py``: 1.6 s -> 0.2 s). Files, checkpoints and records are closed by
    then (the rank's own records are atomic renames; trackers end in their exit handlers, which ran before this);
    what the freeze leaves uncollected is memory the process returns to the OS as it ends."""
    import gc

    gc.freeze()


# DeepSpeed's autotuner, which every ``import deepspeed`` executes, imports mlflow (when installed) only to log
# autotuning experiments: those DeepSpeed's runner runs, never a rank. A rank imports it without mlflow, which stays
# importable for the rank's own code (a user's script that logs to mlflow): ~2 CPU-s less of every rank's start
# where mlflow is installed (benchmarks/rank_imports.py). The built-in entry's ranks leave mlflow out altogether
# unless they log to it (:func:`unused_imports`).
AUTOTUNER_WITHOUT_MLFLOW = ("deepspeed.autotuning.autotuner", ("mlflow",))


def install_startup(accelerator: str, batons: Path, backend: str = "deepspeed") -> None:
    """What every rank needs before any model is built, whatever its entry (the built-in one, the import hook or a
    script calling ftkit.hf): once TrainingArguments exist, DeepSpeed sees the real process group (ZeRO-3's
    partitioned ``from_pretrained`` reads its world size); on CPU ranks, so does Accelerate, and under FSDP2
    Accelerate really shards (:func:`_fsdp_on_cpu_ranks`). Before any op loads, the build locks a killed rank of this
    run left on this machine are removed, and the ones this rank takes are recorded in ``batons``
    (:mod:`ftkit.rundir.batons`). DeepSpeed's autotuner goes without mlflow (:data:`AUTOTUNER_WITHOUT_MLFLOW`)."""
    for lock in release_dead(batons):
        print(f"ftkit: removed {lock}: a build lock a killed rank of this run left on this host", flush=True)
    on_import("torch.utils.file_baton", functools.partial(_record_batons, batons))
    hide_while_importing(*AUTOTUNER_WITHOUT_MLFLOW)
    on_import("deepspeed.runtime.compiler", _compile_on_first_call)
    on_import("transformers.utils.import_utils", _remember_import_structure)
    on_import("transformers.training_args", _share_after_training_args)
    if accelerator == "cpu":
        on_import("accelerate.state", _cpu_ranks_are_one_job)
        if backend == "fsdp2":
            on_import("accelerate.state", _fsdp_on_cpu_ranks)


def _record_batons(records: Path, mod: types.ModuleType) -> None:
    """torch's ``FileBaton``: each baton this process takes is recorded until it gives it back, so one it dies
    holding can be told from a lock someone else left (:func:`ftkit.rundir.batons.release_dead`)."""
    cls = mod.FileBaton
    if getattr(cls.try_acquire, "_ftkit_batons", False):
        return
    acquire, release = cls.try_acquire, cls.release

    @functools.wraps(acquire)
    def try_acquire(self: FileBaton) -> bool | None:
        got = acquire(self)
        if got:
            vars(self)["_ftkit_record"] = record_baton(records, self.lock_file_path)  # ftkit's own, on this baton
        return got

    @functools.wraps(release)
    def release_(self: FileBaton) -> None:
        try:
            release(self)
        finally:
            forget_baton(getattr(self, "_ftkit_record", None))

    try_acquire._ftkit_batons = True  # type: ignore[attr-defined]
    cls.try_acquire, cls.release = try_acquire, release_


def _compile_on_first_call(mod: types.ModuleType) -> None:
    """DeepSpeed's ``compiler.compile()`` (``torch.compile`` as a decorator) compiles a function when it is first
    called; decorating it already loads the whole compiler stack (TorchInductor). ``deepspeed.initialize`` imports
    the Muon optimizer's module on every rank to check the optimizer against it, and its three decorated kernels
    cost every rank of every attempt ~1.4 CPU-s before its first step, whatever the optimizer
    (``benchmarks/rank_imports.py``). Here the decorator is applied at the function's first call instead: a run
    that never steps Muon never loads the compiler; one that does compiles, as before, on that call."""
    original = mod.compile
    if getattr(original, "_ftkit_lazy", False):
        return

    def compile() -> Callable[[Callable[..., Any]], Callable[..., Any]]:  # noqa: A001 (DeepSpeed's own name)
        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            compiled: Callable[..., Any] | None = None

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                nonlocal compiled
                if compiled is None:
                    compiled = original()(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compile._ftkit_lazy = True  # type: ignore[attr-defined]
    mod.compile = compile  # type: ignore[attr-defined]  # deepspeed.runtime.compiler, typed as a plain module


def _py_files_fingerprint(root: str) -> tuple[int, int, int]:
    """(how many, newest mtime, total size) of the ``.py`` files under ``root``: any file added, removed or edited
    changes it (~30 ms for transformers' 2,600 model files)."""
    count = newest = size = 0
    todo = [root]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        todo.append(e.path)
                elif e.name.endswith(".py"):
                    st = e.stat()
                    count, newest, size = count + 1, max(newest, st.st_mtime_ns), size + st.st_size
    return count, newest, size


def _remember_import_structure(mod: types.ModuleType) -> None:
    """transformers builds its lazy import table by reading every model file's ``__all__`` in every process that
    imports it (``define_import_structure`` of ``transformers/models``, twice: ~0.7 CPU-s of every rank's start).
    A rank keeps each table in ``~/.cache/ftkit`` (``XDG_CACHE_HOME``), keyed by the path it was asked for and
    checked against the scanned folder's ``.py`` files (count, newest mtime, total size): any edit, install or upgrade
    builds it anew. Within the process a table is built or read once, as transformers' own ``lru_cache`` does.
    ``marshal`` (no code runs on load); a cache that cannot be read or written is only the scan again."""
    import hashlib
    import marshal

    original = mod.define_import_structure
    if getattr(original, "_ftkit_cached", False):
        return
    root = ftkit_cache()
    tables: dict[tuple[str, str | None], Any] = {}

    def define_import_structure(module_path: str, prefix: str | None = None) -> Any:
        key = (str(module_path), prefix)
        if key in tables:
            return tables[key]
        folder = key[0] if os.path.isdir(key[0]) else os.path.dirname(key[0])  # a file: its folder is scanned
        name = hashlib.sha256(f"{key[0]}\0{prefix}".encode()).hexdigest()[:16]
        path = root / f"transformers-import-structure-{name}.marshal"
        try:
            fingerprint = _py_files_fingerprint(folder)
        except OSError:  # a folder it cannot list: transformers' own scan, and its own error if any
            return original(module_path, prefix)
        try:
            kept, structure = marshal.loads(path.read_bytes())
            if tuple(kept) == fingerprint:
                tables[key] = structure
                return structure
        except (OSError, ValueError, EOFError, TypeError):
            pass
        structure = original(module_path, prefix)
        try:
            data = marshal.dumps((fingerprint, structure))  # before the caller adds to it (transformers does)
            root.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data, fsync=False)
        except (OSError, ValueError):
            pass
        tables[key] = structure
        return structure

    define_import_structure._ftkit_cached = True  # type: ignore[attr-defined]
    mod.define_import_structure = define_import_structure  # type: ignore[attr-defined]


def _cpu_ranks_are_one_job(mod: types.ModuleType) -> None:
    """Accelerate counts CPU processes as one job only when told ``cpu=True`` (``accelerate launch --cpu``, HF
    Trainer's ``use_cpu``); a plain ``Accelerator()`` under torchrun or DeepSpeed's launcher otherwise runs every
    rank as process 0 of a job of its own: no gradient all-reduce, every rank writing the same checkpoint files.
    The process state (``PartialState``) is made CPU on CPU ranks; ``AcceleratorState``'s own flag stays the
    caller's, so HF Trainer's DeepSpeed path (a CPU process state with a DeepSpeed plugin) is unchanged. The
    environment variable ``ACCELERATE_USE_CPU`` would not do: it switches that DeepSpeed path off."""
    import functools

    cls = mod.PartialState
    if getattr(cls.__init__, "_ftkit_cpu", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: PartialState, cpu: bool = False, **kwargs: Any) -> None:  # noqa: ARG001 (always True here)
        original(self, True, **kwargs)

    __init__._ftkit_cpu = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _fsdp_on_cpu_ranks(mod: types.ModuleType) -> None:
    """Accelerate (1.15) turns FSDP on only for GPU-like distributed types: asked for FSDP on CPU processes (the
    environment ``accelerate launch`` sets from an FSDP config, or an explicit plugin) it runs plain DDP over gloo and
    says nothing. On CPU ranks of an FSDP2 run, a MULTI_CPU state given an FSDP plugin becomes FSDP with that plugin,
    as the GPU path would make it; :func:`fsdp2_proof` then checks in every rank that the parameters are DTensors."""
    import functools

    cls = mod.AcceleratorState
    if getattr(cls.__init__, "_ftkit_fsdp", False):
        return
    original = cls.__init__
    distributed_type = mod.DistributedType

    @functools.wraps(original)
    def __init__(self: AcceleratorState, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is None or self.distributed_type != distributed_type.MULTI_CPU:
            return
        self.distributed_type = distributed_type.FSDP
        if self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = plugin
        mod.PartialState._shared_state["distributed_type"] = distributed_type.FSDP

    __init__._ftkit_fsdp = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def fsdp2_proof(model: torch.nn.Module | None) -> dict[str, int]:
    """How many of the model's parameters FSDP2 holds as DTensors (sharded), of how many: every one under FSDP2,
    none under DDP. Raises :class:`FsdpNotOn` when any is a plain tensor."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters()) if model is not None else []
    proof = {"dtensor_params": sum(isinstance(p, DTensor) for p in params), "params": len(params)}
    if not params or proof["dtensor_params"] != proof["params"]:
        raise FsdpNotOn(
            f"train.backend fsdp2: {proof['dtensor_params']} of {proof['params']} parameters are DTensors; FSDP2 is "
            f"not on (the model is {type(model).__name__}: Accelerate fell back to plain data parallel)"
        )
    return proof


def _share_after_training_args(mod: types.ModuleType) -> None:
    cls = mod.TrainingArguments
    if getattr(cls.__post_init__, "_ftkit_share", False):
        return
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self: TrainingArguments, *args: Any, **kwargs: Any) -> None:
        out = original(self, *args, **kwargs)
        share_process_group_with_deepspeed(self)
        return out

    __post_init__._ftkit_share = True  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


def share_process_group_with_deepspeed(targs: TrainingArguments) -> None:
    """On CPU (``use_cpu``) TrainingArguments starts torch.distributed through Accelerate's MULTI_CPU path, which
    leaves ``deepspeed.comm`` uninitialized; ZeRO-3's ``zero.Init`` inside ``from_pretrained`` then reads world size
    1 and fails DeepSpeed's batch-size check (16 != 4 x 2 x 1). Hand the existing group to DeepSpeed (a no-op where
    Accelerate already went through DeepSpeed, as on GPUs, and without a DeepSpeed config)."""
    if not getattr(targs, "deepspeed", None):
        return
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return
    import deepspeed
    from deepspeed import comm

    if not comm.is_initialized():
        deepspeed.init_distributed(dist_backend=getattr(targs, "ddp_backend", None) or None)


class Fault:
    """Test-only fault injection, from ``FTKIT_FAULT_INJECT=ACTION:RANK:STEP[:ATTEMPT]`` (ATTEMPT: a number or
    ``every``; default 0, so a restarted attempt runs clean).

    ACTION is ``exit`` (exit 13 after that step), ``kill`` (SIGKILL itself after that step), ``kill_logged``
    (SIGKILL itself right after that step's loss was logged), ``stop`` (SIGSTOP
    itself: a hang), ``raise`` (an exception after that step) or ``kill_in_save`` (SIGKILL itself in the middle of
    saving checkpoint STEP, after DeepSpeed wrote its shards and before the RNG state and trainer_state.json: a torn
    checkpoint). The processes are real and really die; only the moment is chosen, so tests are not races against a
    millisecond-long save. Works for the built-in entry and any wrapped script (it rides on ftkit.hf.callbacks).

    ``FTKIT_FAULT_PACE=SECONDS``: every rank sleeps that long after each optimizer step, for a test whose run only
    has to keep training until something outside happens (a Slurm time limit): the same steps, a fraction of the CPU.
    """

    def __init__(self, spec: str | None, ctx: RankContext):
        self.action = None
        self.pace = float(os.environ.get(PACE_ENV) or 0)
        if not spec:
            return
        parts = spec.split(":")
        action, rank, step = parts[0], int(parts[1]), int(parts[2])
        attempt = parts[3] if len(parts) > 3 else "0"
        if rank == ctx.rank and (attempt == "every" or int(attempt) == ctx.attempt):
            self.action, self.step = action, step

    def after_log(self, step: int) -> None:
        """``kill_logged``: SIGKILL after the loss of STEP was logged (rank 0 logs it; kill another rank), so every
        step the killed attempt trained is in metrics.jsonl and a resume recomputes each of them."""
        if self.action == "kill_logged" and step == self.step:
            print(f"ftkit fault injection: SIGKILL after logging step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step: int) -> None:
        if self.pace > 0:
            time.sleep(self.pace)
        if self.action is None or self.action == "kill_logged" or step != self.step:
            return
        print(f"ftkit fault injection: {self.action} at step {step}", flush=True)
        if self.action == "exit":
            os._exit(13)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.action == "raise":
            raise RuntimeError(f"fault injection: an exception at step {step}")

    def install_save_kill(self) -> None:
        if self.action != "kill_in_save":
            return
        from transformers import Trainer

        if getattr(Trainer._save_rng_state, "_ftkit_fault", False):
            return
        original = Trainer._save_rng_state
        fault = self

        def _save_rng_state(trainer: Trainer, output_dir: str) -> None:
            if trainer.state.global_step == fault.step:
                print(f"ftkit fault injection: SIGKILL while saving {output_dir}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(trainer, output_dir)

        _save_rng_state._ftkit_fault = True  # type: ignore[attr-defined]
        # fault injection patches transformers' own method (a plain function taking the Trainer as self)
        Trainer._save_rng_state = _save_rng_state  # type: ignore[method-assign,assignment]
