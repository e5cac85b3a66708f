"""Real scripts at every ZeRO stage: entry x ZeRO stage x optimizer offload x engine, each cell a real 2-rank CPU run.

Entries: ftkit's built-in one; an unmodified transformers-example-style script served by the import hook
(``tests/scripts/run_clm.py``); docs/own-script.md's ``ftkit.hf`` script with ``--no-inject``; TRL's own
``python -m trl.scripts.dpo`` on a generated preference set. In every cell rank 1 is SIGKILLed right after the loss of
the last step (4) was logged, so the first attempt trained every step uninterrupted; the resumed attempt must start
from checkpoint-2 (the rank's restored global step 2, its first logged step 3) and recompute steps 3 and 4 exactly
(``resume_tolerance: 0``: any difference stops the run with exit 9), then write the final model.

With CPU optimizer offload the first update after a resume differs from the uninterrupted run's in the last bits
(measured: 2.5e-7 and 7.8e-7 relative in the loss of the step after it, 1.01e-6 in DPO's grad norm at ZeRO-2):
DeepSpeed's CPU Adam keeps Adam's bias corrections beta^t as a float it multiplies by beta at every step, and
recomputes them with ``pow`` when the step does not follow the last one it saw (``csrc/includes/cpu_adam.h``,
``IncrementStep``), as after a resume. Those cells allow 1e-5 relative (``resume_tolerance: 1e-6``; 10x that stops the
run), four orders of magnitude under the loss's change from one step to the next here (8.6% from step 3 to 4 in
DPO's cell), which a resume from the wrong step would show; every other cell is held to 0.

The issue's six cells: the script, DPO and ``ftkit.hf`` entries at ZeRO-3 with and without CPU optimizer offload, on
the three engines; ``make test`` runs two of them (the script with offload on Accelerate, DPO without on torchrun),
``make test-extended`` the other four (tests/conftest.py EXTENDED: the CI budget). ``FTKIT_MATRIX=pairwise`` adds
cells until every pair of values appears in some cell (20 cells, ~12 minutes here: too long for the CI budget next to
everything else); ``make test-matrix`` (``FTKIT_MATRIX=full``) runs every cell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ftkit.errors import ExitCode
from tests.helpers.paths import SCRIPTS
from tests.helpers.readme import readme_example
from tests.helpers.runs import assert_no_process_left, mp_lock, named, write_recipe

pytestmark = pytest.mark.slow

STEPS, SAVE = 4, 2
ENTRIES = ("builtin", "script", "ftkit_hf", "trl_dpo")
ZERO = (0, 1, 2, 3)
OFFLOAD = ("none", "cpu")
ENGINES = ("deepspeed", "accelerate", "torchrun")
# The acceptance cells: each entry at ZeRO-3, with and without CPU optimizer offload.
REQUIRED = (
    ("script", 3, "none", "deepspeed"),
    ("script", 3, "cpu", "accelerate"),
    ("trl_dpo", 3, "none", "torchrun"),
    ("trl_dpo", 3, "cpu", "deepspeed"),
    ("ftkit_hf", 3, "none", "accelerate"),
    ("ftkit_hf", 3, "cpu", "torchrun"),
)


@dataclass(frozen=True)
class Cell:
    entry: str
    zero: int
    offload: str
    engine: str

    @property
    def id(self) -> str:
        return f"{self.entry}-z{self.zero}-{self.offload}-{self.engine}"


def _valid(row: list) -> bool:
    return not (len(row) > 2 and row[1] == 0 and row[2] != "none")  # DeepSpeed offloads from stage 1 on


def cells(which: str) -> list[Cell]:
    """``required`` (the issue's six), ``pairwise`` (those and enough more to cover every pair) or ``full``."""
    if which == "full":
        rows = [[e, z, o, g] for e in ENTRIES for z in ZERO for o in OFFLOAD for g in ENGINES]
        return [Cell(*r) for r in rows if _valid(r)]
    required = [list(r) for r in REQUIRED]
    if which != "pairwise":
        return [Cell(*r) for r in required]
    from allpairspy import AllPairs

    factors = [ENTRIES, ZERO, OFFLOAD, ENGINES]
    extra = [list(r) for r in AllPairs(factors, filter_func=_valid, previously_tested=required)]
    return [Cell(*r) for r in required + extra]


def uncovered_pairs(chosen: list[Cell]) -> list[tuple]:
    """Every pair of values of two different factors that no cell holds (the coverage test)."""
    import itertools

    factors = (ENTRIES, ZERO, OFFLOAD, ENGINES)
    seen = {(i, a, j, b) for c in chosen for (i, a), (j, b) in itertools.combinations(enumerate(_row(c)), 2)}
    missing = []
    for i, j in itertools.combinations(range(4), 2):
        for a in factors[i]:
            for b in factors[j]:
                row = [None] * 4
                row[i], row[j] = a, b
                if (i, a, j, b) not in seen and _valid([row[0], row[1], row[2]]):
                    missing.append((i, a, j, b))
    return missing


def _row(c: Cell) -> tuple:
    return (c.entry, c.zero, c.offload, c.engine)


CELLS = cells(os.environ.get("FTKIT_MATRIX") or "required")


def test_the_pairwise_cells_cover_every_pair_and_the_required_ones():
    for which in ("pairwise", "full"):
        chosen = cells(which)
        assert not uncovered_pairs(chosen), (which, uncovered_pairs(chosen))
        assert {_row(c) for c in chosen} >= set(REQUIRED)


@pytest.fixture(scope="module")
def preference_data(fx, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A preference set made from the fixtures' texts: each prompt's chosen answer is its true continuation."""
    d = tmp_path_factory.mktemp("preference")
    rows = []
    for line in Path(fx["data"]).read_text().splitlines():
        words = json.loads(line)["text"].split()
        if len(words) < 4:
            continue
        cut = len(words) // 2
        rows.append(
            {
                "prompt": " ".join(words[:cut]),
                "chosen": " " + " ".join(words[cut:]),
                "rejected": " " + " ".join(reversed(words[cut:])),
            }
        )
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _command(cell: Cell, fx: dict[str, Path], workdir: Path, preference: Path) -> list[str]:
    if cell.entry == "builtin":
        return []
    if cell.entry == "script":  # its own arguments lose to the recipe where the recipe states a value
        return [
            "--",
            "python",
            str(SCRIPTS / "run_clm.py"),
            "--model_name_or_path",
            str(fx["model"]),
            "--train_file",
            str(fx["data"]),
            "--block_size",
            "32",
            "--do_train",
            "--output_dir",
            str(workdir / "elsewhere"),
            "--per_device_train_batch_size",
            "7",
            "--logging_steps",
            "1",
            "--report_to",
            "none",
        ]
    if cell.entry == "ftkit_hf":
        (workdir / "train.py").write_text(readme_example())
        return ["--no-inject", "--", "python", "train.py", str(fx["model"]), str(fx["data"])]
    return [
        "--",
        "python",
        "-m",
        "trl.scripts.dpo",
        "--model_name_or_path",
        str(fx["model"]),
        "--dataset_name",
        str(preference),
        "--max_length",
        "64",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
    ]


def tolerance(cell: Cell) -> float:
    """The relative difference a recomputed step may show (module docstring: CPU Adam's bias corrections)."""
    return 1e-6 if cell.offload == "cpu" else 0.0


def run_cell(cell: Cell, fx: dict[str, Path], workdir: Path, preference: Path) -> dict:
    recipe = write_recipe(
        workdir,
        fx,
        train__max_steps=STEPS,
        train__save_steps=SAVE,
        zero__stage=cell.zero,
        zero__offload_optimizer=cell.offload,
        cluster__engine=cell.engine,
        resilience__resume_tolerance=tolerance(cell),
    )
    env = {k: v for k, v in os.environ.items() if k != "FTKIT_FAULT_INJECT"}
    env.update(
        {
            "DS_ACCELERATOR": "cpu",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "FTKIT_FAULT_INJECT": f"kill_logged:1:{STEPS}",
        }
    )
    t0 = time.monotonic()
    with mp_lock():
        r = subprocess.run(
            [sys.executable, "-m", "ftkit", "launch", str(recipe), *_command(cell, fx, workdir, preference)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=workdir,
        )
    return {"proc": r, "seconds": time.monotonic() - t0, "run": workdir / "run", "tolerance": tolerance(cell)}


def assert_resumed_exactly(res: dict) -> None:
    r, run = res["proc"], res["run"]
    assert r.returncode == ExitCode.OK, r.stdout[-5000:] + r.stderr[-3000:]
    assert len(named(run, "restart")) == 1, named(run, "failure")
    chosen = [Path(e["checkpoint"]).name for e in named(run, "checkpoint_chosen")]
    assert chosen == [f"checkpoint-{SAVE}"], chosen
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    by_attempt: dict[int, dict[int, float]] = {}
    for m in rows:
        if "loss" in m:
            by_attempt.setdefault(m["attempt"], {})[m["step"]] = m["loss"]
    first, again = by_attempt.get(0, {}), by_attempt.get(1, {})
    assert sorted(first) == list(range(1, STEPS + 1)), first  # the uninterrupted run, to the last step
    assert min(again) == SAVE + 1 and sorted(again) == list(range(SAVE + 1, STEPS + 1)), again  # resumed at K+1
    tol = 10 * res["tolerance"]  # 0: every recomputed step equal, bit for bit
    assert all(abs(first[s] - again[s]) <= tol * abs(first[s]) for s in again), (first, again)
    beats = [json.loads(p.read_text()) for p in (run / "ftkit" / "heartbeat").glob("rank-*.json")]
    assert beats and all(b["attempt"] == 1 and b["started_at_step"] == SAVE for b in beats), beats
    assert (run / "final" / "ftkit_commit.json").is_file()
    assert_no_process_left(run)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell_killed_once_resumes_exactly(cell: Cell, fx, preference_data, tmp_path):
    res = run_cell(cell, fx, tmp_path, preference_data)
    print(f"matrix cell {cell.id}: {res['seconds']:.1f} s")
    assert_resumed_exactly(res)
    if cell.entry == "script":  # the recipe's values won, each listed once; nothing went where the script said
        out = res["proc"].stdout
        assert out.count("per_device_train_batch_size: 7 -> 4") == 1 and out.count("output_dir: ") == 1, out[-3000:]
        assert not (tmp_path / "elsewhere").exists()
