"""The real DeepSpeed runner, fed the argv ftkit builds for a slot selection (``--include localhost:1,3`` on
``localhost slots=4``): its ranks start on the selected devices. What the command holds, engine by engine, is checked
without running it in tests/cluster/test_hostfile.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.mark.slow
def test_deepspeed_runner_puts_the_selected_ranks_on_the_selected_devices(tmp_path: Path, write_recipe) -> None:
    """The real DeepSpeed runner, fed ftkit's argv (the training module swapped for a stub that writes down what it
    sees): `--include localhost:1,3` on `localhost slots=4` starts 2 ranks with CUDA_VISIBLE_DEVICES=1,3."""
    from ftkit.command.engines import TRAIN_MODULE, build_launch
    from ftkit.plan.load import load_and_plan
    from ftkit.run.job import launch_inputs

    (tmp_path / "stub").mkdir()
    (tmp_path / "stub" / "showdev.py").write_text(
        "import os, pathlib\n"
        "e = os.environ\n"
        "seen = ' '.join((e['RANK'], e['LOCAL_RANK'], e['CUDA_VISIBLE_DEVICES']))\n"
        "pathlib.Path(f\"seen.{e['RANK']}\").write_text(seen)\n"
    )
    (tmp_path / "hostfile").write_text("localhost slots=4\n")
    overrides = [f"cluster.hostfile={tmp_path / 'hostfile'}", "cluster.engine=deepspeed", "cluster.master_port=29617"]
    plan = load_and_plan(str(write_recipe()), overrides, include="localhost:1,3")
    cmd = build_launch(launch_inputs(plan), {**os.environ, "DS_ACCELERATOR": "cpu"})
    for path, text in cmd.files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    (node,) = cmd.nodes
    argv = list(node.argv)
    argv = [*argv[: argv.index(TRAIN_MODULE)], "showdev"]
    env = {**node.env, "PYTHONPATH": str(tmp_path / "stub")}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # One file per rank: two ranks printing to the runner's shared stdout interleave (seen in CI: "SEEN 0 0SEEN  1,3").
    seen = sorted(f.read_text().split() for f in tmp_path.glob("seen.*"))
    assert seen == [["0", "0", "1,3"], ["1", "1", "1,3"]], out.stdout[-3000:]
