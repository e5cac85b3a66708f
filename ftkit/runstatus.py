"""Summaries of a run directory: attempts, restarts, steps, losses, checkpoints (committed or rejected, why)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoints import COMMIT_FILE, list_checkpoints, verify
from .rundir import RunDir


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash: skip it
    return out


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
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    final: Path | None = None
    outcome: str | None = None
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["run_dir"] = str(self.run_dir)
        d["final"] = str(self.final) if self.final else None
        return d


def summarize(run_dir: str | Path, *, checksums: bool = False) -> RunSummary:
    rd = RunDir(run_dir)
    events = read_jsonl(rd.events)
    metrics = read_jsonl(rd.metrics)
    launches = [e for e in events if e.get("event") == "launch"]
    restarts = [e for e in events if e.get("event") == "restart"]
    # The latest attempt's value wins for a step recomputed after a restart.
    by_step: dict[int, tuple[float, int]] = {}
    for m in metrics:
        if "loss" in m and "step" in m:
            by_step[int(m["step"])] = (float(m["loss"]), int(m.get("attempt", 0)))
    losses = [(s, loss, a) for s, (loss, a) in sorted(by_step.items())]
    all_losses = [
        (int(m["step"]), float(m["loss"]), int(m.get("attempt", 0))) for m in metrics if "loss" in m and "step" in m
    ]
    spec = json.loads(rd.spec.read_text()) if rd.spec.exists() else {}
    resumed = [e for e in events if e.get("event") == "checkpoint_chosen"]
    ckpts = []
    for step, path in list_checkpoints(rd.path):
        v = verify(path, checksums=checksums)
        ckpts.append({"step": step, "path": str(path), "committed": v.ok, "reason": v.reason if not v.ok else ""})
    for p in sorted(rd.path.glob("checkpoint-*.rejected-*")):
        ckpts.append({"step": None, "path": str(p), "committed": False, "reason": "set aside by a restart"})
    outcome = None
    for e in reversed(events):
        if e.get("event") in ("finished", "gave_up", "interrupted", "refused", "no_valid_checkpoint", "failed"):
            outcome = e.get("message") or e["event"]
            break
    return RunSummary(
        run_dir=rd.path,
        attempts=len(launches),
        restarts=len(restarts),
        step=losses[-1][0] if losses else None,
        max_steps=(spec.get("training_args") or {}).get("max_steps"),
        first_loss=losses[0][1] if losses else None,
        last_loss=losses[-1][1] if losses else None,
        losses=losses,
        all_losses=all_losses,
        restart_steps=[int(e.get("step") or 0) for e in resumed],
        checkpoints=ckpts,
        final=rd.final if (rd.final / COMMIT_FILE).exists() else None,
        outcome=outcome,
        failures=[e.get("message", "") for e in events if e.get("event") == "failure"],
    )


def format_summary(s: RunSummary) -> str:
    lines = [f"run: {s.run_dir}"]
    if s.outcome:
        lines.append(f"outcome: {s.outcome}")
    steps = f"{s.step}" + (f"/{s.max_steps}" if s.max_steps else "") if s.step is not None else "none yet"
    lines.append(f"attempts: {s.attempts}   restarts: {s.restarts}   step: {steps}")
    if s.first_loss is not None:
        lines.append(f"loss: {s.first_loss:.4f} at step {s.losses[0][0]} -> {s.last_loss:.4f} at step {s.step}")
    for f in s.failures:
        lines.append(f"failure: {f}")
    if s.checkpoints:
        lines.append("checkpoints:")
        for c in s.checkpoints:
            state = "committed" if c["committed"] else f"rejected ({c['reason']})"
            lines.append(f"  {Path(c['path']).name}: {state}")
    rd = RunDir(s.run_dir)
    lines.append(f"final model: {s.final or 'not written'}")
    lines.append(f"logs: {rd.path / 'logs'}   events: {rd.events}   metrics: {rd.metrics}")
    return "\n".join(lines)


def plot_losses(s: RunSummary, out: Path) -> Path:
    """Loss against step, one colour per attempt, a dashed line where a restart resumed. Needs matplotlib."""
    try:
        import matplotlib
    except ImportError:
        from .errors import UserError

        raise UserError("--plot needs matplotlib: pip install 'ftkit[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    attempts = sorted({a for _, _, a in s.all_losses})
    for a in attempts:
        pts = [(st, loss) for st, loss, att in s.all_losses if att == a]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"attempt {a}", alpha=0.85)
    for i, st in enumerate(s.restart_steps):
        ax.axvline(
            st,
            color="red",
            linestyle="--",
            alpha=0.7,
            label="restart: resumed from this step's checkpoint" if i == 0 else None,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{s.run_dir.name}: {s.restarts} restart(s); steps after a restart line were recomputed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
