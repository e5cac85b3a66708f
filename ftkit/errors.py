"""ftkit's exception types and the exit codes they map to.

Library code raises these; the CLI turns them into a clean message and an exit code in one place
(``ftkit.cli.main``). Never ``assert`` on user input.
"""

from __future__ import annotations

from dataclasses import dataclass


class ExitCode:
    """Stable, documented exit codes of every ftkit command (docs/exit-codes.md)."""

    OK = 0
    DRIFT = 1  # ftkit check: configs on disk differ from a fresh render
    USAGE = 2  # bad recipe, bad hostfile, bad command line, bad data
    PREFLIGHT = 3  # a preflight check failed before anything was started
    BUDGET_EXHAUSTED = 4  # the restart budget ran out (or failures repeated without progress)
    NO_CHECKPOINT = 5  # a restart needed a valid checkpoint and none verified
    TRAINING_FAILED = 6  # the job failed in a way a restart cannot fix (e.g. the engine exited 0 without a model)
    HOST_LOST = 7  # a host was lost and cluster.min_nodes does not allow continuing without it
    STOPPED = 8  # stopped on request after a committed save (graceful stop; reserved until it lands)
    RESUME_MISMATCH = 9  # a resumed attempt recomputed logged steps and got other losses: resumed state is wrong
    NOTHING_FITS = 10  # ftkit plan: no candidate fits the GPUs (a finding, not a usage error)
    RUN_BUSY = 11  # the run directory is owned by a live job, or ranks of a dead supervisor still run
    NO_SPACE = 12  # no space left on a device the run writes to
    VERIFY_FAILED = 13  # ftkit status --verify: a checkpoint failed verification
    SCRIPT_FAILED = 14  # the training script failed before its first step (import, argument or setup error)
    EXPORT_MISMATCH = 15  # ftkit export: the exported model's logits differ from the checkpoint's training state
    SIGINT = 130
    SIGTERM = 143


@dataclass(frozen=True)
class Problem:
    """One thing wrong with user input: where (file, line, key as the user spells it) and what."""

    message: str
    file: str | None = None
    line: int | None = None
    key: str | None = None

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file + (f":{self.line}" if self.line else "")
        if self.key:
            where = f"{where} {self.key}" if where else self.key
        return f"{where}: {self.message}" if where else self.message


class FtkitError(Exception):
    """Base of ftkit's errors; ``exit_code`` is what the CLI exits with."""

    exit_code = ExitCode.USAGE

    def lines(self) -> list[str]:
        return str(self).splitlines() or [type(self).__name__]


class UserError(FtkitError):
    """A mistake in something the user wrote: recipe, hostfile, command line, data. Exit 2, no traceback."""

    def __init__(self, problems: list[Problem] | Problem | str):
        if isinstance(problems, str):
            problems = [Problem(problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def lines(self) -> list[str]:
        return [str(p) for p in self.problems]


class RecipeError(UserError):
    """The recipe (file or overrides) is invalid; carries every problem found, not just the first."""


class HostfileError(UserError):
    """The hostfile is invalid; the message quotes the offending line."""


class ModelConfigError(UserError):
    """The model's config.json is missing or lacks what ftkit needs (e.g. a hidden size)."""


class DataError(UserError):
    """The training data is missing, empty or malformed; the message names the file and row."""


class PreflightError(FtkitError):
    """A check before spawning failed (host unreachable, port taken, versions differ, run dir not writable)."""

    exit_code = ExitCode.PREFLIGHT


class BudgetExhausted(FtkitError):
    exit_code = ExitCode.BUDGET_EXHAUSTED


class NoValidCheckpoint(FtkitError):
    exit_code = ExitCode.NO_CHECKPOINT


class TrainingFailed(FtkitError):
    exit_code = ExitCode.TRAINING_FAILED


class HostLost(FtkitError):
    exit_code = ExitCode.HOST_LOST


class ScriptFailed(FtkitError):
    """The training script failed before its first step: restarting cannot fix an import or argument error."""

    exit_code = ExitCode.SCRIPT_FAILED


class SaveWroteNothing(ScriptFailed):
    """The Trainer's checkpoint save wrote no checkpoint directory (a subclass overriding ``_save_checkpoint``):
    every save would do the same, so a restart cannot help (exit 14 at once, whatever the step)."""


class FsdpNotOn(ScriptFailed):
    """``train.backend: fsdp2`` but the model's parameters are not DTensors: Accelerate ran plain data parallel.
    Every restart would do the same (exit 14 at once)."""


class ExportMismatch(FtkitError):
    """ftkit export: the written model does not give the checkpoint's logits (nothing was put in place)."""

    exit_code = ExitCode.EXPORT_MISMATCH


class RunBusy(FtkitError):
    """Another live job owns the run directory (or a dead supervisor's ranks still run there)."""

    exit_code = ExitCode.RUN_BUSY


class NoSpace(FtkitError):
    """A write failed with ENOSPC: one line naming the path."""

    exit_code = ExitCode.NO_SPACE


def os_error(e: OSError, path: object, doing: str) -> FtkitError:
    """An OSError as one user-facing line naming the path: NoSpace (exit 12) for ENOSPC, else UserError (exit 2)."""
    import errno

    where = str(getattr(e, "filename", None) or path)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"{doing}: no space left on {where}")
    return UserError(Problem(f"{doing}: {e.strerror or e}", file=where))
