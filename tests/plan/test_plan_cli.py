"""``ftkit plan`` as a user reads it: the table's columns, and how long a plan takes with absurd inputs (issue 36's
rough edges: the s/step and tokens/s columns ran together, ``train.micro_batch_size=1000000`` searched for minutes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from ftkit.plan import memory
from ftkit.plan.candidates import full_table
from ftkit.plan.load import load_and_plan

BIG = ["cluster.num_nodes=64", "cluster.master_addr=10.0.0.1", "train.micro_batch_size=64"]
BIG += ["train.global_batch_size=32768", "data.max_seq_len=4096", "zero.stage=auto"]


def test_step_time_and_tokens_per_second_columns_never_run_together(write_recipe, tmp_path: Path) -> None:
    """A tiny model on 512 GPUs moves hundreds of millions of tokens a second: the tokens/s cell is wider than its
    column was, and ``0.00129101,690,034`` could not be read back. Every row's two cells parse to the JSON's numbers."""
    p = write_recipe()
    run = [sys.executable, "-m", "ftkit", "plan", str(p), *BIG]
    text = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path)
    data = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, cwd=tmp_path).stdout)
    by_label = {c["candidate"]: c for c in data["candidates"]}
    rows = [line for line in text.stdout.splitlines() if line.split("  ")[0].strip() in by_label]
    assert len(rows) == len(by_label), text.stdout
    assert max(c["tokens_per_s"] for c in by_label.values()) >= 1e8  # wide enough to overflow the old column
    for row in rows:
        c = by_label[row.split("  ")[0].strip()]
        m = re.search(r"\s(\S+)\s+([\d,]+)\s+(?:fits|no):", row)
        assert m, row
        assert float(m.group(1)) == float(f"{c['step_time_s']:.3g}"), row
        assert abs(int(m.group(2).replace(",", "")) - c["tokens_per_s"]) <= 0.5, row  # rounded half either way


def test_a_huge_micro_batch_is_planned_without_trying_every_smaller_one(write_recipe, monkeypatch) -> None:
    """``train.micro_batch_size=1000000``: the suggestion "lower the micro batch to N" tried every N below a million
    (minutes). The search halves now: a few dozen estimates, and N is the largest micro batch that fits."""
    p = write_recipe()
    calls = 0
    real = memory.estimate

    def counting(c, w):  # noqa: ANN001, ANN202
        nonlocal calls
        calls += 1
        return real(c, w)

    monkeypatch.setattr(memory, "estimate", counting)
    plan = load_and_plan(str(p), ["train.micro_batch_size=1000000", "train.global_batch_size=8000000"], strict=False)
    rep = full_table(plan)
    assert calls < 3000, calls
    tip = next(s for s in rep.suggestions if s.startswith("lower train.micro_batch_size to "))
    n = int(tip.split()[3])
    w = rep.workload
    fits = memory.choose(memory.estimate_all(memory.replace(w, micro_batch_size=n)), 80, None, 0.1).chosen
    over = memory.choose(memory.estimate_all(memory.replace(w, micro_batch_size=n + 1)), 80, None, 0.1).chosen
    assert fits is not None and over is None, (n, tip)


def test_calibrate_refuses_what_is_not_a_measured_run_in_one_line(write_recipe, tmp_path: Path) -> None:
    p = write_recipe()
    (tmp_path / "empty").mkdir()
    (tmp_path / "young" / "ftkit").mkdir(parents=True)
    (tmp_path / "young" / "ftkit" / "spec.json").write_text(json.dumps({"recipe": {}, "hosts": [["localhost", 1]]}))
    (tmp_path / "young" / "metrics.jsonl").write_text('{"step": 1, "attempt": 0, "time": 1.0, "loss": 2.0}\n')
    for run, says in (
        (tmp_path / "empty", "not an ftkit run directory (no ftkit/spec.json)"),
        (tmp_path / "young", "too few logged steps to measure a step time (metrics.jsonl)"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "ftkit", "plan", str(p), "--calibrate", str(run)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [f"ftkit: error: {run}: {says}"], out.stderr
    assert not (tmp_path / "run").exists()  # nothing kept
