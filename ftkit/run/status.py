"""Summaries of a run directory: attempts, restarts, steps, losses and eval losses, checkpoints (committed or
rejected, why), Slurm job events, and hosts that straggle.

What is malformed and what is merely odd: a line of ``events.jsonl`` or ``metrics.jsonl`` that is not a JSON object
(a line cut by a crash, or hand-edited), and a metrics line whose step or loss is not a number, is skipped and
counted in ``RunSummary.skipped`` (the summary still prints: the rest of the file is intact). A file the summary
needs but cannot read (a directory where a file belongs, a symlink loop, no permission) or a ``ftkit/spec.json``
that is not a JSON object raises :class:`ftkit.errors.UserError` naming the path (exit 2): ftkit writes those
files atomically, so such damage is not a crash artefact and the summary would be guesswork. A checkpoint that
cannot be read is reported as rejected, with the OS's reason.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeVar, cast

from ftkit.checkpoint.directory import list_checkpoints, list_set_aside
from ftkit.checkpoint.layout import read_commit
from ftkit.checkpoint.tiers import node_dir
from ftkit.checkpoint.verify import verify
from ftkit.cluster.hosts import is_local
from ftkit.errors import ExitCode, FtkitError, NoSpace, Problem, UserError
from ftkit.report.goodput import GoodputDict, goodput
from ftkit.rundir import layout
from ftkit.rundir.layout import RunDir
from ftkit.rundir.outputs import check_output_file, starts_with
from ftkit.rundir.records import JSON, Event, JSONObject, MetricsRecord, as_int, as_number
from ftkit.supervise.stragglers import score_run

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.typing import ColorType

_Record = TypeVar("_Record", JSONObject, Event, MetricsRecord)


class VerifyFailed(FtkitError):
    """``ftkit status --verify``: a checkpoint or final/ failed verification (after the summary is printed)."""

    exit_code = ExitCode.VERIFY_FAILED


def _unreadable(path: Path, e: OSError) -> UserError:
    return UserError(Problem(f"cannot read ({e.strerror or e}); the run directory is damaged", file=str(path)))


def _read_text(path: Path) -> str | None:
    """The file's text, None when it does not exist; any other OS error is the user's problem (exit 2)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _unreadable(path, e) from None


def _read(
    reader: Callable[[Path, dict[str, int] | None], list[_Record]], path: Path, skipped: dict[str, int] | None
) -> list[_Record]:
    try:
        return reader(path, skipped)
    except OSError as e:
        raise _unreadable(path, e) from None


def read_jsonl(path: Path, skipped: dict[str, int] | None = None) -> list[JSONObject]:
    """:func:`ftkit.rundir.layout.read_jsonl`, with an unreadable file (not a missing one) as one line, exit 2."""
    return _read(layout.read_jsonl, path, skipped)


def read_events(path: Path, skipped: dict[str, int] | None = None) -> list[Event]:
    """:func:`ftkit.rundir.layout.read_events`, with an unreadable file as one line, exit 2 (:func:`read_jsonl`)."""
    return _read(layout.read_events, path, skipped)


def read_metrics(path: Path, skipped: dict[str, int] | None = None) -> list[MetricsRecord]:
    """:func:`ftkit.rundir.layout.read_metrics`, with an unreadable file as one line, exit 2 (:func:`read_jsonl`)."""
    return _read(layout.read_metrics, path, skipped)


class CheckpointState(TypedDict):
    """A ``checkpoint-N`` (or a set-aside copy: step None) and whether it verifies."""

    step: int | None
    path: str
    committed: bool
    reason: str  # why not ("" when committed)


class SlurmEvent(TypedDict):
    """A ``slurm`` event's fields that the summary shows (None: not recorded)."""

    job_id: str | None
    restart_count: int | None
    reason: str | None
    time: float | None


class SummaryDict(TypedDict):
    """:meth:`RunSummary.as_dict` (``ftkit status --json``): the summary's fields, paths as text."""

    run_dir: str
    attempts: int
    restarts: int
    step: int | None
    max_steps: int | None
    first_loss: float | None
    last_loss: float | None
    losses: list[tuple[int, float, int]]
    all_losses: list[tuple[int, float, int]]
    restart_steps: list[int]
    resumes: list[tuple[int, int, str]]
    checkpoints: list[CheckpointState]
    final: str | None
    outcome: str | None
    failures: list[str]
    final_problem: str | None
    verified: bool
    skipped: dict[str, int]
    running: str | None
    eval_losses: list[tuple[int, float, int]]
    slurm: list[SlurmEvent]
    stragglers: list[str]
    goodput: GoodputDict | None
    local_tier: list[str]
    verify_failures: list[str]


@dataclass
class RunSummary:
    run_dir: Path
    attempts: int
    restarts: int
    step: int | None
    max_steps: int | None
    first_loss: float | None
    last_loss: float | None
    losses: list[tuple[int, float, int]]  # (step, loss, attempt): the latest attempt's value per step
    all_losses: list[tuple[int, float, int]]  # every logged value, including steps a restart recomputed
    restart_steps: list[int]  # the step each restarted attempt resumed from
    resumes: list[tuple[int, int, str]] = field(default_factory=list)  # (attempt, step, tier: local|peer|durable)
    checkpoints: list[CheckpointState] = field(default_factory=list)
    final: Path | None = None
    outcome: str | None = None
    failures: list[str] = field(default_factory=list)
    final_problem: str | None = None  # final/ exists but does not verify
    verified: bool = False  # checkpoints were checked against their checksums, not only sizes
    skipped: dict[str, int] = field(default_factory=dict)  # file name -> malformed lines skipped
    running: str | None = None  # who runs it now, or that its ranks run unsupervised (ftkit.run.ownership.liveness)
    eval_losses: list[tuple[int, float, int]] = field(default_factory=list)  # (step, eval loss, attempt), latest
    slurm: list[SlurmEvent] = field(default_factory=list)  # {"job_id", "restart_count", "reason"} events
    stragglers: list[str] = field(default_factory=list)  # one line per slow host (ftkit.supervise.stragglers)
    goodput: GoodputDict | None = None  # productive / wall time and the largest loss (ftkit.report.goodput)
    local_tier: list[str] = field(default_factory=list)  # the run's local tier directories on this host, with sizes

    @property
    def recomputed(self) -> list[tuple[int, float, int]]:
        """Values a failed attempt logged for steps that a later attempt computed again (and whose value counts)."""
        kept = {(step, attempt) for step, _, attempt in self.losses}
        return [(st, loss, a) for st, loss, a in self.all_losses if (st, a) not in kept]

    @property
    def verify_failures(self) -> list[str]:
        """Why each ``checkpoint-N`` or final/ failed verification (set-aside copies are expected, not failures)."""
        out = [c["reason"] for c in self.checkpoints if c["step"] is not None and not c["committed"]]
        return out + ([self.final_problem] if self.final_problem else [])

    def as_dict(self) -> SummaryDict:
        d = self.__dict__.copy()
        d["run_dir"] = str(self.run_dir)
        d["final"] = str(self.final) if self.final else None
        d["verify_failures"] = self.verify_failures
        return cast("SummaryDict", d)


def _read_spec(path: Path) -> JSONObject:
    text = _read_text(path)
    if text is None:
        return {}
    try:
        spec: JSON = json.loads(text)
    except ValueError as e:
        raise UserError(
            Problem(f"does not parse as JSON ({e}); the run directory is damaged", file=str(path))
        ) from None
    if not isinstance(spec, dict):
        raise UserError(Problem("is not a JSON object; the run directory is damaged", file=str(path)))
    return spec


def _final_problem(final: Path, checksums: bool) -> tuple[bool, str | None]:
    """(final/ is committed and verifies, why not when it exists but does not)."""
    try:
        if not final.exists() and not final.is_symlink():
            return False, None
        if read_commit(final) is None:
            return False, "final: no commit record: the final save did not finish"
    except (OSError, ValueError):
        pass  # verify() reports an unreadable record in its own words
    v = verify(final, checksums)
    return v.ok, None if v.ok else v.reason


# The events that end a launch (or, written by the ranks themselves, a run whose supervisor was gone).
OUTCOME_EVENTS = (
    "finished",
    "gave_up",
    "interrupted",
    "stopped",
    "refused",
    "no_valid_checkpoint",
    "failed",
    "orphan_finished",
    "orphan_stopped",
)


def summarize(run_dir: str | Path, *, checksums: bool = False) -> RunSummary:
    """Read RUN_DIR's events, metrics, spec and checkpoints; ``checksums`` re-reads every checkpoint file."""
    rd = RunDir(run_dir)
    skipped: dict[str, int] = {}
    events = read_events(rd.events, skipped)
    metrics = read_metrics(rd.metrics, skipped)
    launches = [e for e in events if e.get("event") == "launch"]
    restarts = [e for e in events if e.get("event") == "restart"]
    all_losses: list[tuple[int, float, int]] = []
    evals: dict[int, tuple[float, int]] = {}
    for m in metrics:
        if "eval_loss" in m and "loss" not in m:
            step, loss, attempt = (
                as_int(m.get("step")),
                as_number(m.get("eval_loss"), finite=False),
                as_int(m.get("attempt", 0)),
            )
            if step is None or loss is None or attempt is None:
                skipped[rd.metrics.name] = skipped.get(rd.metrics.name, 0) + 1
            else:
                evals[step] = (loss, attempt)  # a recomputed step's evaluation: the latest attempt's value
            continue
        if "loss" not in m:
            continue  # another kind of line (commit events, ...)
        step, loss, attempt = as_int(m.get("step")), as_number(m.get("loss"), finite=False), as_int(m.get("attempt", 0))
        if step is None or loss is None or attempt is None:
            skipped[rd.metrics.name] = skipped.get(rd.metrics.name, 0) + 1
            continue
        all_losses.append((step, loss, attempt))
    # The latest attempt's value wins for a step recomputed after a restart.
    by_step = {step: (loss, attempt) for step, loss, attempt in all_losses}
    losses = [(s, loss, a) for s, (loss, a) in sorted(by_step.items())]
    spec = _read_spec(rd.spec)
    targs = spec.get("training_args")
    max_steps = as_int(targs.get("max_steps")) if isinstance(targs, dict) else None
    resumed = [e for e in events if e.get("event") == "checkpoint_chosen"]
    ckpts: list[CheckpointState] = []
    try:
        found = list_checkpoints(rd.path)
        set_aside = list_set_aside(rd.path)
    except OSError as err:
        raise _unreadable(rd.path, err) from None
    for step, path in found:
        v = verify(path, checksums)
        ckpts.append({"step": step, "path": str(path), "committed": v.ok, "reason": v.reason if not v.ok else ""})
    for _, p in set_aside:
        ckpts.append({"step": None, "path": str(p), "committed": False, "reason": "set aside by a restart"})
    final_ok, final_problem = _final_problem(rd.final, checksums)
    outcome = None
    for e in reversed(events):
        if e.get("event") in OUTCOME_EVENTS:
            outcome = str(e.get("message") or e["event"])
            break
    return RunSummary(
        run_dir=rd.path,
        attempts=len(launches),
        restarts=len(restarts),
        step=losses[-1][0] if losses else None,
        max_steps=max_steps,
        first_loss=losses[0][1] if losses else None,
        last_loss=losses[-1][1] if losses else None,
        losses=losses,
        all_losses=all_losses,
        restart_steps=[as_int(e.get("step")) or 0 for e in resumed],
        resumes=[
            (as_int(e.get("attempt")) or 0, as_int(e.get("step")) or 0, str(e.get("tier") or "durable"))
            for e in events
            if e.get("event") == "launch" and e.get("resume")
        ],
        checkpoints=ckpts,
        final=rd.final if final_ok else None,
        outcome=outcome,
        failures=[_failure_line(e) for e in events if e.get("event") == "failure"],
        final_problem=final_problem,
        verified=checksums,
        skipped=skipped,
        eval_losses=[(st, loss, a) for st, (loss, a) in sorted(evals.items())],
        slurm=[
            {
                "job_id": e.get("job_id"),
                "restart_count": e.get("restart_count"),
                "reason": e.get("reason"),
                "time": e.get("time"),
            }
            for e in events
            if e.get("event") == "slurm"
        ],
        stragglers=score_run(rd.path).lines(),
        goodput=goodput(events, metrics).as_dict(),
        local_tier=_local_tier_here(spec),
    )


def _failure_line(e: Event) -> str:
    """A failure event as one line: its message, else what it recorded (an older or hand-made record has none)."""
    if e.get("message"):
        return str(e["message"])
    kind, step = e.get("kind"), e.get("step")
    return f"{kind or 'a failure'} (no message recorded)" + (f" at step {step}" if step is not None else "")


def _local_tier_here(spec: JSONObject) -> list[str]:
    """The run's local tier directories that exist on this host (its nodes that are this machine), each with what it
    holds: a run whose supervisor was killed leaves them (in /dev/shm: host memory)."""
    tier = spec.get("local_tier")
    if not isinstance(tier, dict) or not isinstance(tier.get("dir"), str):
        return []
    nodes = tier.get("nodes")
    out = []
    for host in nodes if isinstance(nodes, list) else []:
        if not isinstance(host, str) or not is_local(host):
            continue
        d = node_dir(str(tier["dir"]), host)
        if not os.path.lexists(d):
            continue
        try:
            ckpts = sum(1 for _ in list_checkpoints(d))
            size = sum(f.lstat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())
            out.append(f"{d}: {ckpts} checkpoint(s), {size / 2**20:.1f} MiB")
        except OSError as e:
            out.append(f"{d}: {e.strerror or e}")
    return out


def format_summary(s: RunSummary) -> str:
    lines = [f"run: {s.run_dir}"]
    if s.running:
        lines.append(f"now: {s.running}")
    if s.outcome:
        lines.append(f"outcome: {s.outcome}")
    steps = f"{s.step}" + (f"/{s.max_steps}" if s.max_steps else "") if s.step is not None else "none yet"
    lines.append(f"attempts: {s.attempts}   restarts: {s.restarts}   step: {steps}")
    if s.goodput:
        lines.append(s.goodput["line"])
    if s.resumes:
        said = [f"attempt {a} from step {step} ({tier})" for a, step, tier in s.resumes[-5:]]
        more = f" and {len(s.resumes) - 5} earlier" if len(s.resumes) > 5 else ""
        lines.append("resumed: " + ", ".join(said) + more)
    if s.first_loss is not None:
        lines.append(f"loss: {s.first_loss:.4f} at step {s.losses[0][0]} -> {s.last_loss:.4f} at step {s.step}")
    if s.eval_losses:
        (s0, e0, _), (s1, e1, _) = s.eval_losses[0], s.eval_losses[-1]
        best = min(s.eval_losses, key=lambda t: t[1])
        lines.append(
            f"eval loss: {e0:.4f} at step {s0} -> {e1:.4f} at step {s1} (best {best[1]:.4f} at step {best[0]}, "
            f"{len(s.eval_losses)} evaluation{'s' if len(s.eval_losses) != 1 else ''})"
        )
    lines += _slurm_lines(s.slurm)
    lines += s.stragglers
    for f in s.failures:
        lines.append(f"failure: {f}")
    if s.checkpoints:
        lines.append("checkpoints:")
        for c in s.checkpoints:
            state = "committed" if c["committed"] else f"rejected ({c['reason']})"
            lines.append(f"  {Path(c['path']).name}: {state}")
    rd = RunDir(s.run_dir)
    if s.final_problem:
        lines.append(f"final model: rejected ({s.final_problem})")
    else:
        lines.append(f"final model: {s.final or 'not written'}")
    if s.verified:
        bad = len(s.verify_failures)
        lines.append(
            "verify: every file checked against its checksum: "
            + (f"{bad} failed" if bad else "all committed checkpoints and the final model verify")
        )
    for name, n in sorted(s.skipped.items()):
        lines.append(f"note: {name}: {n} malformed line(s) skipped (not a JSON object, or no numeric step/loss)")
    for where in s.local_tier:
        if s.running:
            lines.append(f"local tier: {where}")
        else:
            lines.append(
                f"local tier left behind: {where}; the next `ftkit launch` of this run copies what is due from it "
                "and removes it"
            )
    lines.append(f"logs: {rd.path / 'logs'}   events: {rd.events}   metrics: {rd.metrics}")
    return "\n".join(lines)


def _slurm_lines(events: list[SlurmEvent]) -> list[str]:
    """``slurm: job 4242, requeued 2 times`` then one line per event, oldest first (the last 10)."""
    if not events:
        return []
    jobs = list(dict.fromkeys(str(e.get("job_id")) for e in events if e.get("job_id") is not None))
    requeues = max((as_int(e.get("restart_count")) or 0 for e in events), default=0)
    head = f"slurm: job {', '.join(jobs) or '?'}, requeued {requeues} time{'s' if requeues != 1 else ''}"
    out = [head]
    if len(events) > 10:
        out.append(f"  ... {len(events) - 10} earlier event(s) in events.jsonl")
    for e in events[-10:]:
        n = as_int(e.get("restart_count"))
        out.append(f"  {'start' if not n else f'requeue {n}'}: {e.get('reason') or 'no reason recorded'}")
    return out


@dataclass(frozen=True)
class Series:
    """One line of the loss plot, as data: what plot_losses draws (and what its tests check)."""

    label: str
    steps: list[int]
    values: list[float]
    kind: str  # "train" (the losses that count), "recomputed" (a failed attempt's, computed again later), "eval"
    attempt: int | None = None


def loss_series(s: RunSummary) -> list[Series]:
    """The plot's lines: per attempt the training losses that count; per failed attempt, in a lighter style, the
    steps it computed that a later attempt recomputed (on CPU they coincide with the new values); eval loss."""
    out = []
    recomputed = s.recomputed
    for a in sorted({a for _, _, a in s.losses} | {a for _, _, a in recomputed}):
        pts = [(st, loss) for st, loss, att in s.losses if att == a]
        if pts:
            out.append(Series(f"attempt {a}", [p[0] for p in pts], [p[1] for p in pts], "train", a))
        gone = [(st, loss) for st, loss, att in recomputed if att == a]
        if gone:
            label = f"attempt {a}: steps recomputed later"
            out.append(Series(label, [p[0] for p in gone], [p[1] for p in gone], "recomputed", a))
    if s.eval_losses:
        out.append(Series("eval loss", [e[0] for e in s.eval_losses], [e[1] for e in s.eval_losses], "eval"))
    return out


def loss_figure(s: RunSummary) -> Figure:
    """The matplotlib Figure of :func:`plot_losses` (the caller closes it): loss against step, one colour per
    attempt, a dashed line where a restart resumed, the steps a failed attempt computed before they were recomputed
    in a lighter style (under the values that count: on CPU they coincide), eval loss as crosses."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'ftkit[plot]'") from None
    matplotlib.use("Agg")
    with matplotlib.rc_context({"text.parse_math": False}):  # a run directory's name may hold `$` (not mathtext)
        return _loss_figure(s)


def _loss_figure(s: RunSummary) -> Figure:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    colours: dict[int | None, ColorType] = {}
    for line in loss_series(s):
        if line.kind == "train":
            (drawn,) = ax.plot(line.steps, line.values, marker=".", label=line.label, alpha=0.85, zorder=3)
            colours[line.attempt] = drawn.get_color()
        elif line.kind == "recomputed":  # drawn under the values that count, wider and paler, so both show
            ax.plot(
                line.steps,
                line.values,
                marker="o",
                markersize=7,
                markerfacecolor="none",
                linestyle=":",
                linewidth=2.5,
                alpha=0.35,
                color=colours.get(line.attempt),
                label=line.label,
                zorder=2,
            )
        else:
            ax.plot(line.steps, line.values, marker="x", linestyle="--", color="black", label=line.label, zorder=4)
    for i, st in enumerate(s.restart_steps):
        ax.axvline(
            st,
            color="red",
            linestyle="--",
            alpha=0.7,
            label="restart: resumed from this step's checkpoint" if i == 0 else None,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{s.run_dir.name}: {s.restarts} restart(s); steps after a restart line were recomputed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


PLOT_SOFTWARE = "ftkit status --plot"  # the PNG's Software text: how a plot ftkit wrote is recognised


def is_plot(path: Path) -> bool:
    """A PNG :func:`plot_losses` wrote (what ``--plot`` may replace without ``--force``)."""
    return starts_with(path, b"\x89PNG", b"Software\x00" + PLOT_SOFTWARE.encode())


def plot_target(out: str | Path, force: bool = False) -> Path:
    """``--plot``'s path, checked before anything is drawn: never in a run's own state, its directory must exist,
    and what is there must be a plot ftkit wrote unless ``force`` (:mod:`ftkit.rundir.outputs`; exit 2)."""
    return check_output_file(out, ours=is_plot, force=force, what="loss plot", key="--plot")


def plot_losses(s: RunSummary, out: Path) -> Path:
    """Write :func:`loss_figure` as a PNG to ``out`` (checked by :func:`plot_target` first). Needs matplotlib."""
    fig = loss_figure(s)
    import matplotlib
    import matplotlib.pyplot as plt

    try:
        with matplotlib.rc_context({"text.parse_math": False}):  # tick labels are made while saving
            fig.savefig(out, format="png", metadata={"Software": PLOT_SOFTWARE})
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(f"{out}: cannot write the plot: no space left on {e.filename or out.parent}") from None
        raise UserError(
            Problem(f"cannot write the plot ({e.strerror or e}) [give a writable file path]", file=str(out))
        ) from None
    finally:
        plt.close(fig)
    return out
