"""`ftkit status` on run directories built by hand (no training): odd content, damaged content, --verify, --plot.

The contract (``ftkit status --help``): a readable run directory prints its summary and exits 0, even when some
lines of events.jsonl/metrics.jsonl are malformed (they are skipped and counted in a note); a file the summary needs
that cannot be read (a directory where a file belongs, a symlink loop, a path under a regular file), a damaged
``ftkit/spec.json``, or a --plot path that cannot be written ends with exactly one ``ftkit: error:`` line and exit
2; ``--verify`` exits 13 after the summary when a checkpoint-N or final/ fails. Never a traceback.

Permissions cannot be tested with chmod here (the tests run as root, which bypasses it): unreadability is produced
with a directory where a file is expected, a path under a regular file, and symlink loops, which stop root too.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from ftkit.checkpoint.commit import manifest_part, write_commit
from ftkit.checkpoint.directory import set_aside_newer
from ftkit.errors import ExitCode
from tests.helpers.ckpt import MiB, commit, flip_byte, make_ckpt
from tests.helpers.cli import run_ftkit
from tests.helpers.rundir import write_rank


def _jsonl(path: Path, rows: list[object], extra: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)


def make_run(tmp_path: Path) -> Path:
    """A finished two-attempt run: events, metrics, spec, checkpoints 10 and 20 (committed) and final/."""
    run = tmp_path / "run"
    (run / "ftkit").mkdir(parents=True)
    _jsonl(
        run / "events.jsonl",
        [
            {"event": "launch", "attempt": 1, "time": 1.0},
            {"event": "failure", "message": "rank 1 exited with -9", "time": 2.0},
            {"event": "restart", "attempt": 2, "time": 3.0},
            {"event": "checkpoint_chosen", "step": 10, "time": 3.1},
            {"event": "launch", "attempt": 2, "time": 3.2},
            {"event": "finished", "message": "finished at step 20", "time": 4.0},
        ],
    )
    metrics = [{"step": s, "loss": 4.0 - s / 10, "attempt": 1} for s in range(1, 13)]
    metrics += [{"event": "commit", "step": 10, "commit_s": 0.01, "attempt": 1}]
    metrics += [{"step": s, "loss": 4.0 - s / 10, "attempt": 2} for s in range(11, 21)]
    _jsonl(run / "metrics.jsonl", metrics)
    (run / "ftkit/spec.json").write_text(json.dumps({"training_args": {"max_steps": 20}}))
    commit(make_ckpt(run, 10))
    commit(make_ckpt(run, 20, optim_bytes=9 * MiB))
    final = run / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(os.urandom(4096))
    write_commit(final, [manifest_part(final, 0, 1)], step=20, world_size=2, stage=2, recipe_hash="h", kind="model")
    return run


def _loop(path: Path) -> None:
    """Replace ``path`` by a symlink to itself: every open or stat of it fails with ELOOP, even for root."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    os.symlink(path.name, path)


def _redirect(path: Path, kind: str) -> None:
    """Put a directory where a file belongs, or a file where a directory belongs (a path under a regular file)."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    if kind == "dir":
        path.mkdir()
    else:
        path.write_text("not a directory")


Mutation = Callable[[Path], object]

# (id, damage, expected exit, a substring of the one error line or of stdout)
ODD_BUT_READABLE: list[tuple[str, Mutation, str]] = [
    (
        "events-non-object-lines",
        lambda r: (r / "events.jsonl").write_text(
            (r / "events.jsonl").read_text() + '[1, 2]\n"text"\nnull\n42\n\n{"event": "lau\n'
        ),
        "note: events.jsonl: 5 malformed line(s) skipped",
    ),
    (
        "metrics-null-and-text-losses",
        lambda r: _jsonl(
            r / "metrics.jsonl",
            [
                {"step": 1, "loss": 4.0, "attempt": 1},
                {"step": 2, "loss": None, "attempt": 1},
                {"step": 3, "loss": "nan-ish", "attempt": 1},
                {"step": "four", "loss": 3.6, "attempt": 1},
                {"step": None, "loss": 3.5},
                {"step": 6, "loss": True},
                ["step", 7],
                {"step": 8, "loss": 3.2, "attempt": "x"},
                {"step": 9, "loss": 3.1, "attempt": 1},
            ],
        ),
        "note: metrics.jsonl: 7 malformed line(s) skipped",
    ),
    ("events-empty", lambda r: (r / "events.jsonl").write_text(""), "attempts: 0"),
    ("metrics-missing", lambda r: (r / "metrics.jsonl").unlink(), "step: none yet"),
    ("spec-missing", lambda r: (r / "ftkit/spec.json").unlink(), "restarts: 1   step: 20\n"),
    ("spec-odd-training-args", lambda r: (r / "ftkit/spec.json").write_text('{"training_args": [1]}'), "step: 20"),
    (
        "checkpoint-name-is-a-loop",
        lambda r: os.symlink("checkpoint-30", r / "checkpoint-30"),
        "checkpoint-20: committed",
    ),
    (
        "file-in-checkpoint-is-a-loop",
        lambda r: _loop(r / "checkpoint-20/scheduler.pt"),
        "checkpoint-20: rejected (checkpoint-20: cannot read scheduler.pt (",
    ),
    (
        "final-is-a-loop",
        lambda r: _loop(r / "final"),
        "final model: rejected (final: not a directory)",
    ),
    (
        "final-without-record",
        lambda r: (r / "final/ftkit_commit.json").unlink(),
        "final model: rejected (final: no commit record: the final save did not finish)",
    ),
]

DAMAGED: list[tuple[str, Mutation, str]] = [
    ("spec-broken-json", lambda r: (r / "ftkit/spec.json").write_text('{"training_'), "spec.json: does not parse"),
    ("spec-not-an-object", lambda r: (r / "ftkit/spec.json").write_text("[1, 2]"), "spec.json: is not a JSON object"),
    ("spec-is-a-directory", lambda r: _redirect(r / "ftkit/spec.json", "dir"), "spec.json: cannot read"),
    ("spec-is-a-loop", lambda r: _loop(r / "ftkit/spec.json"), "spec.json: cannot read"),
    ("ftkit-dir-is-a-file", lambda r: _redirect(r / "ftkit", "file"), "spec.json: cannot read"),
    ("events-is-a-directory", lambda r: _redirect(r / "events.jsonl", "dir"), "events.jsonl: cannot read"),
    ("events-is-a-loop", lambda r: _loop(r / "events.jsonl"), "events.jsonl: cannot read"),
    ("metrics-is-a-directory", lambda r: _redirect(r / "metrics.jsonl", "dir"), "metrics.jsonl: cannot read"),
    ("metrics-is-a-loop", lambda r: _loop(r / "metrics.jsonl"), "metrics.jsonl: cannot read"),
]


def _one_error_line(out, code: int) -> str:  # noqa: ANN001
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftkit: error: "), out.stderr
    return lines[0]


def test_intact_run_summary_and_verify(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    out = run_ftkit("status", str(run), "--verify")
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert "step: 20/20" in out.stdout and "checkpoint-20: committed" in out.stdout
    assert f"final model: {run / 'final'}" in out.stdout
    assert "verify: every file checked against its checksum: all committed checkpoints" in out.stdout


@pytest.mark.parametrize(("damage", "expect"), [c[1:] for c in ODD_BUT_READABLE], ids=[c[0] for c in ODD_BUT_READABLE])
def test_odd_but_readable_content_still_summarises(tmp_path: Path, damage: Mutation, expect: str) -> None:
    run = make_run(tmp_path)
    damage(run)
    out = run_ftkit("status", str(run))
    assert (out.returncode, out.stderr) == (0, ""), (out.stdout, out.stderr)
    assert expect in out.stdout, out.stdout


@pytest.mark.parametrize(("damage", "expect"), [c[1:] for c in DAMAGED], ids=[c[0] for c in DAMAGED])
def test_damaged_run_directory_is_one_line_exit_2(tmp_path: Path, damage: Mutation, expect: str) -> None:
    run = make_run(tmp_path)
    damage(run)
    line = _one_error_line(run_ftkit("status", str(run)), ExitCode.USAGE)
    assert expect in line and str(run) in line, line


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (lambda t: t / "missing", "does not exist"),
        (lambda t: (t / "f").write_text("x") and t / "f", "not a directory"),
        (lambda t: (t / "f").write_text("x") and t / "f" / "run", "does not exist"),
        (lambda t: (t / "empty").mkdir() or t / "empty", "not an ftkit run directory"),
        (lambda t: os.symlink("loop", t / "loop") or t / "loop", "does not exist"),
    ],
    ids=["missing", "a-file", "under-a-file", "not-a-run", "a-symlink-loop"],
)
def test_run_dir_argument_is_one_line_exit_2(tmp_path: Path, make: Callable[[Path], Path], expect: str) -> None:
    line = _one_error_line(run_ftkit("status", str(make(tmp_path))), ExitCode.USAGE)
    assert expect in line, line


@pytest.mark.parametrize(
    ("damage", "expect"),
    [
        (
            lambda r: [
                flip_byte(r / "checkpoint-20/global_step20/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", o)
                for o in range(4 * MiB, 4 * MiB + 16)
            ],
            "verification failed: checkpoint-20: global_step20/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt checksum",
        ),
        (lambda r: flip_byte(r / "final/model.safetensors", 100), "verification failed: final: model.safetensors"),
        (lambda r: make_ckpt(r, 30), "verification failed: checkpoint-30: no commit record"),
        (lambda r: _loop(r / "final"), "verification failed: final: not a directory"),
    ],
    ids=["flipped-shard", "flipped-final", "uncommitted", "final-loop"],
)
def test_verify_failure_exits_13_after_the_summary(
    tmp_path: Path, damage: Mutation, expect: str, request: pytest.FixtureRequest
) -> None:
    run = make_run(tmp_path)
    damage(run)
    assert run_ftkit("status", str(run)).returncode == 0  # without --verify: a summary, not a verdict
    for extra in ((), ("--json",)) if "flipped-shard" in request.node.name else ((),):
        out = run_ftkit("status", str(run), "--verify", *extra)
        line = _one_error_line(out, ExitCode.VERIFY_FAILED)
        assert expect in line, line
        assert ("verify_failures" if extra else "verify: every file checked against its checksum: 1 failed") in (
            out.stdout
        )


def test_set_aside_checkpoints_do_not_fail_verify(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    make_ckpt(run, 30)
    from ftkit.checkpoint.directory import select_resume

    assert len(set_aside_newer(run, select_resume(run))) == 1
    out = run_ftkit("status", str(run), "--verify")
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert "(set aside by a restart)" in out.stdout


@pytest.mark.slow  # seconds of CPU: kept out of make test-fast (under a minute on 2 cores)
def test_plot_to_a_bad_path_is_one_line_exit_2(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = make_run(tmp_path)
    (tmp_path / "file").write_text("x")
    (tmp_path / "adir").mkdir()
    for bad, says in (
        (tmp_path / "file" / "loss.png", "does not exist (or is not a directory)"),
        (tmp_path / "adir", "is a directory"),
        (tmp_path / "plots" / "loss.png", "does not exist"),  # a mistyped directory is not created
    ):
        line = _one_error_line(run_ftkit("status", str(run), "--plot", str(bad)), ExitCode.USAGE)
        assert f"{bad} --plot: " in line and says in line, line
    assert not (tmp_path / "plots").exists()
    good = tmp_path / "loss.png"
    for _ in range(2):  # a plot ftkit wrote is replaced without --force
        out = run_ftkit("status", str(run), "--plot", str(good))
        assert (out.returncode, out.stderr) == (0, "") and good.read_bytes()[:4] == b"\x89PNG"


def test_plot_never_writes_into_a_runs_state_nor_over_what_it_did_not_write(tmp_path: Path) -> None:
    """Issue 36: what `ftkit report -o` must not do, `--plot` must not either (checked before anything is read)."""
    from ftkit.errors import UserError
    from ftkit.run.status import plot_target

    run = make_run(tmp_path)
    mine = tmp_path / "holiday.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n a photo")
    for target in (run / "metrics.jsonl", run / "final" / "model.safetensors", run / "ftkit" / "loss.png", run):
        for force in (False, True):
            with pytest.raises(UserError, match="the run's own state|is the run directory"):
                plot_target(target, force)
    with pytest.raises(UserError, match=r"exists and is not a loss plot ftkit wrote \(--force replaces it\)"):
        plot_target(mine)
    assert plot_target(mine, force=True) == mine and plot_target(run / "loss.png") == run / "loss.png"
    line = _one_error_line(run_ftkit("status", str(run), "--plot", str(run / "events.jsonl")), ExitCode.USAGE)
    assert "the run's own state" in line, line


# ---------------------------------------------------------------------------------------------------------------
# Eval loss, recomputed steps in the plot, Slurm events, stragglers (issues 11, 12, 13)


def _append(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))


def test_eval_loss_in_status_and_json(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    _append(
        run / "metrics.jsonl",
        [
            {"step": 10, "eval_loss": 3.5, "attempt": 1, "time": 1.0},
            {"step": 10, "eval_loss": 3.25, "attempt": 2, "time": 2.0},  # recomputed after the restart: counts
            {"step": 20, "eval_loss": 3.0, "attempt": 2, "time": 3.0},
        ],
    )
    out = run_ftkit("status", str(run))
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert "eval loss: 3.2500 at step 10 -> 3.0000 at step 20 (best 3.0000 at step 20, 2 evaluations)" in out.stdout
    assert "note:" not in out.stdout  # eval lines are not malformed loss lines
    data = json.loads(run_ftkit("status", str(run), "--json").stdout)
    assert data["eval_losses"] == [[10, 3.25, 2], [20, 3.0, 2]]


@pytest.mark.heavy
def test_plot_draws_recomputed_steps_in_a_lighter_style_and_eval_loss(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from ftkit.run.status import loss_figure, summarize

    run = make_run(tmp_path)  # attempt 1 logged steps 1-12, died; attempt 2 resumed from 10 and logged 11-20
    _append(run / "metrics.jsonl", [{"step": 20, "eval_loss": 2.5, "attempt": 2}])
    s = summarize(run)
    assert [(st, a) for st, _, a in s.recomputed] == [(11, 1), (12, 1)]
    fig = loss_figure(s)
    try:
        lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
        main1, gone, main2 = lines["attempt 1"], lines["attempt 1: steps recomputed later"], lines["attempt 2"]
        assert list(main1.get_xdata()) == list(range(1, 11)) and list(main2.get_xdata()) == list(range(11, 21))
        assert list(gone.get_xdata()) == [11, 12] and list(gone.get_ydata()) == [4.0 - 1.1, 4.0 - 1.2]
        assert gone.get_alpha() < main1.get_alpha() and gone.get_color() == main1.get_color()
        assert list(lines["eval loss"].get_xdata()) == [20]
    finally:
        plt.close(fig)
    png = tmp_path / "loss.png"
    out = run_ftkit("status", str(run), "--plot", str(png))
    assert (out.returncode, out.stderr) == (0, "") and png.read_bytes()[:4] == b"\x89PNG"


def test_slurm_events_in_status(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    _append(
        run / "events.jsonl",
        [
            {"event": "slurm", "job_id": "4242", "restart_count": 0, "reason": "started in allocation n[1-2]"},
            {"event": "slurm", "job_id": "4242", "restart_count": 1, "reason": "preempted (USR1): saved step 13"},
            {"event": "slurm", "job_id": "4242", "restart_count": 2, "reason": "time limit (USR1): saved step 17"},
        ],
    )
    out = run_ftkit("status", str(run))
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert (
        "slurm: job 4242, requeued 2 times\n"
        "  start: started in allocation n[1-2]\n"
        "  requeue 1: preempted (USR1): saved step 13\n"
        "  requeue 2: time limit (USR1): saved step 17\n"
    ) in out.stdout
    assert "slurm:" not in run_ftkit("status", str(make_run(tmp_path / "plain"))).stdout


def test_status_names_a_straggling_host_with_numbers(tmp_path: Path) -> None:
    from ftkit.rundir.layout import RunDir

    run = make_run(tmp_path)
    rd = RunDir(run)
    for rank, host, compute_s in [(0, "n1", 0.25), (1, "n1", 0.26), (2, "n2", 0.61), (3, "n2", 0.60)]:
        write_rank(rd, rank, host, compute_s, 14, attempt=2)
    out = run_ftkit("status", str(run))
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert (
        "straggler: host n2 (ranks 2, 3): 0.605 s compute per step, 2.37x the other hosts' median 0.255 s, "
        "over 14 steps (threshold 1.5x after 10 steps)"
    ) in out.stdout
    assert json.loads(run_ftkit("status", str(run), "--json").stdout)["stragglers"][0].startswith("straggler: host n2")
    write_rank(rd, 2, "n2", 0.27, 14, attempt=2)
    write_rank(rd, 3, "n2", 0.27, 14, attempt=2)
    assert "straggler" not in run_ftkit("status", str(run)).stdout


def test_a_gracefully_stopped_run_has_an_outcome_line(tmp_path: Path) -> None:
    """`ftkit status` of a run stopped on request used to print no outcome line at all."""
    run = make_run(tmp_path)
    lines = (run / "events.jsonl").read_text().splitlines()[:-1]  # not finished: stopped at step 13 instead
    stopped = {"event": "stopped", "message": "stopped on request (SIGTERM): checkpoint committed at step 13"}
    (run / "events.jsonl").write_text("\n".join([*lines, json.dumps(stopped)]) + "\n")
    out = run_ftkit("status", str(run))
    assert "outcome: stopped on request (SIGTERM): checkpoint committed at step 13" in out.stdout, out.stdout


@pytest.mark.heavy
def test_plot_of_a_run_whose_directory_name_holds_dollar_signs(tmp_path: Path) -> None:
    """Issue 36, item 15: the plot's title names the run directory; `$...$` in it was parsed as mathtext (and a
    name matplotlib cannot parse crashed `ftkit status --plot`)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from ftkit.run.status import loss_figure, plot_losses, summarize

    run = make_run(tmp_path)
    odd = run.rename(tmp_path / "run$\\frac{1}{$")
    s = summarize(odd)
    fig = loss_figure(s)
    try:
        assert fig.axes[0].get_title().startswith("run$\\frac{1}{$: ")
    finally:
        plt.close(fig)
    png = plot_losses(s, tmp_path / "loss.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_failure_without_a_message_is_said_not_left_blank(tmp_path: Path) -> None:
    """Issue 36 (rough edges): a failure record without a message printed as "failure: " (and as "None" in a
    tier's clean-up lines): the summary says what the record holds."""
    run = make_run(tmp_path)
    _append(run / "events.jsonl", [{"event": "failure", "kind": "hang", "step": 14, "time": 5.0}])
    out = run_ftkit("status", str(run))
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert "failure: hang (no message recorded) at step 14" in out.stdout and "failure: \n" not in out.stdout
    assert "None" not in out.stdout, out.stdout
