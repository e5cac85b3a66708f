"""The import hook: ftkit's per-rank services for a script that never heard of ftkit (docs/design.md, Wrapping a
user's script).

Mechanism. For ``ftkit launch RECIPE -- CMD`` ftkit puts ``launch/inject`` (shipped as ``ftkit/launch/inject``)
first on the ranks' ``PYTHONPATH``, for that run only (``--dry-run`` shows it; ``--no-inject`` leaves it out).
That directory holds one file, ``sitecustomize.py``, which Python imports at start-up in every process of the run.
It first runs any other ``sitecustomize`` further on the path (a site's own keeps working), then, only in a rank
of an ftkit run (``FTKIT_RUN_DIR`` and ``RANK``/``LOCAL_RANK`` set, and not a child process a rank started), calls
:func:`install`:

* :func:`ftkit.hf.start` at once: per-rank log, pid record, heartbeat, supervisor watchdog;
* ``sys.excepthook`` and ``argparse.ArgumentParser.error``: an uncaught exception (an import error, an argument
  error, a bug at any step) writes the rank's error record (``ftkit/attempts/N/errors/rank-R.json``: kind, lines,
  exit code 14, the traceback's last lines, and ``step``: None when no training step began in this process, else
  the trainer's global step). Before the first step the supervisor stops at once instead of restarting a
  script that cannot start; after it, the failure is restarted and the no-progress rule stops a repeating one,
  the traceback shown either way;
* a post-import hook (:func:`ftkit.launch.rank.on_import`) on two modules of ``transformers``, wrapping once
  (whichever class the script uses: TRL's trainers and configs are subclasses):

  - ``TrainingArguments.__post_init__``: the recipe's values (:func:`ftkit.hf.recipe_arguments`) are set on the
    object *before* HF's own ``__post_init__`` runs, so the DeepSpeed config HF builds there is ftkit's, and
    ZeRO-3's partitioned loading sees it before the model is built. A ``--deepspeed`` config the script passed is
    replaced, never merged. Every value that changed is listed (:func:`ftkit.hf.record_changes`);
  - ``Trainer.__init__``: ftkit's callbacks (:func:`ftkit.hf.callbacks`: commit records, heartbeat, metrics,
    graceful stop, fault injection) are added, unless the script added them itself;
  - ``Trainer.train``: resumes from the checkpoint ftkit chose and verified (:func:`ftkit.hf.resume_checkpoint`),
    never HF's ``get_last_checkpoint``; a different ``resume_from_checkpoint`` from the script (``True``, a path)
    is overridden and listed;
  - ``Trainer.save_model`` (the script's own call after training, not the checkpoint saves): a model saved to the
    run directory (``output_dir``, which the recipe sets) goes to ``RUN/final`` and gets its commit record
    (:func:`save_final`), so the supervisor knows the run finished; elsewhere it is saved as asked, and committed
    into ``RUN/final`` as well.

Importing this module costs nothing heavy: transformers is patched when the script imports it.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypedDict

from ftkit.errors import NoSpace, ScriptFailed
from ftkit.launch import services as hf
from ftkit.launch.rank import on_import
from ftkit.rundir.env import HOOK_PID_ENV, RUN_DIR_ENV
from ftkit.rundir.failures import COMM, EXCEPTION, NO_SPACE, SCRIPT_EXIT, FailureClass, classify, full_path

if TYPE_CHECKING:
    import argparse
    import weakref

    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import TrainOutput

    from ftkit.launch.services import ArgChange

TRACEBACK_LINES = 20  # the last lines of a traceback kept in the error record


class _Training(TypedDict):
    began: bool  # a training step began in this process
    trainer: weakref.ReferenceType[Trainer] | None  # by whom


_training: _Training = {"began": False, "trainer": None}
_installed = False


def should_install(environ: Mapping[str, str], pid: int) -> bool:
    """A rank of an ftkit run (not the engine's launcher, not a process the rank started)."""
    if not environ.get(RUN_DIR_ENV):
        return False
    if environ.get("RANK", "") == "" and environ.get("LOCAL_RANK", "") == "":
        return False  # torchrun's agent, DeepSpeed's launcher, accelerate launch: they start the ranks
    owner = environ.get(HOOK_PID_ENV, "")
    return owner in ("", str(pid))


def install() -> None:
    """Called by ``launch/inject/sitecustomize.py`` at interpreter start-up; does nothing outside a rank."""
    global _installed
    if _installed or not should_install(os.environ, os.getpid()):
        return
    _installed = True
    os.environ[HOOK_PID_ENV] = str(os.getpid())

    hf.context().hooked = True
    hf.context().heartbeat("starting")
    _install_error_hooks()
    on_import("transformers.training_args", _patch_training_args)
    on_import("transformers.trainer", _patch_trainer)
    print(f"ftkit: import hook installed ({__name__}): TrainingArguments, Trainer.__init__, Trainer.train", flush=True)


# ------------------------------------------------------------------------------------------------ post-import


def _patch_training_args(mod: types.ModuleType) -> None:
    cls = mod.TrainingArguments
    if getattr(cls.__post_init__, "_ftkit", False):
        return
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self: TrainingArguments, *args: Any, **kwargs: Any) -> None:
        apply_recipe(self)
        return original(self, *args, **kwargs)

    __post_init__._ftkit = True  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


def apply_recipe(args: TrainingArguments) -> list[ArgChange]:
    """Set the recipe's TrainingArguments values on ``args`` in place (before HF's ``__post_init__`` derives
    anything from them); list and record each value that changed."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(args) if f.init}
    changes: list[ArgChange] = []
    for name, new in hf.recipe_arguments().items():
        if name not in fields:
            continue
        old = getattr(args, name, None)
        if _plain(old) != _plain(new):
            changes.append((name, old, new))
            setattr(args, name, new)
    if changes:
        for name, old, new in changes:
            print(f"ftkit: {type(args).__name__}.{name}: {_plain(old)!r} -> {_plain(new)!r} (recipe)", flush=True)
        hf.record_changes(changes)
    return changes


def _plain(v: object) -> object:
    """Enums (save_strategy, lr_scheduler_type) compare by value; a one-element report_to list like the string."""
    return getattr(v, "value", v)


def _patch_trainer(mod: types.ModuleType) -> None:
    cls = mod.Trainer
    if getattr(cls.__init__, "_ftkit", False):
        return
    original_init, original_train, original_save = cls.__init__, cls.train, cls.save_model

    @functools.wraps(original_init)
    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _add_callbacks(self)

    @functools.wraps(original_train)
    def train(self: Trainer, *args: Any, **kwargs: Any) -> TrainOutput:

        if args:
            given, args = args[0], args[1:]
        else:
            given = kwargs.pop("resume_from_checkpoint", None)
        chosen = hf.resume_checkpoint()
        if given not in (None, False) and given != chosen:
            print(f"ftkit: Trainer.train(resume_from_checkpoint={given!r}) -> {chosen!r} (ftkit's choice)", flush=True)
            hf.record_changes([("resume_from_checkpoint", given, chosen)])
        return original_train(self, chosen, *args, **kwargs)

    @functools.wraps(original_save)
    def save_model(self: Trainer, output_dir: str | None = None, _internal_call: bool = False) -> str | None:
        if _internal_call:  # a checkpoint save: HF's own path, committed by ftkit's callback
            return original_save(self, output_dir, _internal_call=True)

        return hf.save_trained(self, output_dir, original_save)

    __init__._ftkit = True  # type: ignore[attr-defined]
    save_model._ftkit = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls.train = train
    cls.save_model = save_model


def _add_callbacks(trainer: Trainer) -> None:

    ours = hf.callback_class()
    if not any(isinstance(cb, ours) for cb in trainer.callback_handler.callbacks):
        for cb in hf.callbacks():
            trainer.add_callback(cb)
    trainer.add_callback(_step_watcher())
    import weakref

    _training["trainer"] = weakref.ref(trainer)


@functools.lru_cache(maxsize=1)
def _step_watcher_class() -> type[TrainerCallback]:
    from transformers import TrainerCallback

    class StepWatcher(TrainerCallback):
        """Whether a training step began in this process (an exception before that is a start-up failure)."""

        def on_step_begin(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
        ) -> None:
            _training["began"] = True

    return StepWatcher


def _step_watcher() -> TrainerCallback:
    return _step_watcher_class()()


# ------------------------------------------------------------------------------------------------ failures


def _install_error_hooks() -> None:
    import argparse
    import builtins

    previous = sys.excepthook

    def excepthook(tp: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        try:
            frames = [f.filename for f in traceback.extract_tb(tb)]
            names = [c.__name__ for c in tp.__mro__]
            record_failure(traceback.format_exception(tp, value, tb), f"{tp.__name__}: {value}", names, frames)
        finally:
            previous(tp, value, tb)

    sys.excepthook = excepthook
    original_error = argparse.ArgumentParser.error

    @functools.wraps(original_error)
    def error(self: argparse.ArgumentParser, message: str) -> NoReturn:
        record_failure(
            [f"{self.prog}: error: {message}"], f"argument error: {self.prog}: {message}", exit_class=SCRIPT_EXIT
        )
        original_error(self, message)  # exits

    argparse.ArgumentParser.error = error  # type: ignore[method-assign]

    # sys.exit("dataset not found") / sys.exit(3) before the first step: SystemExit never reaches the excepthook, so
    # the supervisor saw only an exit status, restarted the script until its budget ran out and never showed why
    def exiting(original: Callable[..., NoReturn]) -> Callable[..., NoReturn]:
        @functools.wraps(original)
        def exit(status: object = None) -> NoReturn:
            if status not in (None, 0) and not _training["began"]:
                text = f"SystemExit: {status}" if isinstance(status, str) else f"SystemExit: exit status {status}"
                record_failure([text], text, exit_class=SCRIPT_EXIT)
            original(status)

        return exit

    sys.exit = exiting(sys.exit)
    for name in ("exit", "quit"):
        if callable(getattr(builtins, name, None)):
            setattr(builtins, name, exiting(getattr(builtins, name)))


def record_failure(
    text: list[str],
    summary: str,
    type_names: list[str] | None = None,
    frames: list[str] | None = None,
    exit_class: FailureClass | None = None,
) -> bool:
    """The rank's error record (exit code 14) with the traceback's last lines, the failure's class and the last step
    this process completed (None: it failed before its first step). A peer's echo (a collective failing because
    another rank died) gets no record: the supervisor finds the rank that really failed. Returns whether written.

    Before the first step a wrapped script's failure is not restartable unless its class is (a collective, a GPU
    fault): the script would meet its own exception again (``restartable`` in the record)."""
    step = None
    if _training["began"]:
        trainer = _training["trainer"]() if _training["trainer"] is not None else None
        step = int(trainer.state.global_step) if trainer is not None else -1
    try:
        own = [str(p) for p in hf.write_paths()]
    except Exception:  # noqa: BLE001 - classify without them
        own = []
    cls = exit_class or classify(type_names or [], summary, frames or [], before_first_step=step is None, own=own)
    if cls is COMM:
        return False
    full = full_path(summary, None, own)
    if full is not None:  # a save filled the run directory or the local tier: exit 12 naming it, not restarted
        try:
            hf.context().record_error(NoSpace(f"no space left on {full}"), step=step, failure_class=NO_SPACE.name)
            return True
        except OSError:
            return False
    when = "before its first step" if step is None else f"after step {step}"
    try:
        lines = [x for chunk in text for x in chunk.rstrip("\n").splitlines()]
        ctx = hf.context()
        ctx.record_error(
            ScriptFailed(f"rank {ctx.rank}: the script failed {when}: {summary}"),
            traceback=lines[-TRACEBACK_LINES:],
            step=step,
            failure_class=cls.name,
            restartable=cls.restartable and cls is not EXCEPTION,
            summary=summary,
        )
        return True
    except Exception as e:  # noqa: BLE001 - never hide the script's own error behind ours
        print(f"ftkit: could not record the error: {e}", file=sys.stderr, flush=True)
        return False
