"""The Slurm engine and ``ftkit submit`` without a Slurm: the srun command inside an allocation (hosts from
``SLURM_JOB_NODELIST``), what a launch outside one says, ``engine: auto``, the batch script of ``submit --dry-run``
and its lead time, one-line errors. On a real Slurm: tests/integration/slurm/test_slurm.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ftkit.errors import ExitCode
from tests.helpers.slurm import clean_env, slurm_ftkit


@pytest.fixture
def slurm_recipe(write_recipe) -> Path:
    return write_recipe(
        """\
        model: {path: ./model}
        data: {train: ./data.jsonl}
        train: {output_dir: ./runs/s, micro_batch_size: 1, global_batch_size: 4, max_steps: 5}
        cluster: {engine: slurm, num_nodes: 2, gpus_per_node: 2, accelerator: cpu}
        resilience: {stop_timeout_s: 90}
        """
    )


def test_srun_engine_command_inside_an_allocation(slurm_recipe: Path) -> None:
    """Hosts from SLURM_JOB_NODELIST, master = first host, a per-job port and rendezvous id, srun and no ssh."""
    env = clean_env(SLURM_JOB_ID="77", SLURM_JOB_NODELIST="gpu[09-10]", SLURM_CONF="/x/slurm.conf")
    r = slurm_ftkit("launch", str(slurm_recipe), "--dry-run", env=env, cwd=slurm_recipe.parent)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "plan: slurm on 2 node(s): gpu09 (2), gpu10 (2); world size 4" in out
    assert "engine: slurm" in out and "node 0 (gpu09):" in out and "over ssh" not in out
    argv = out.strip().splitlines()[-1].split()
    assert argv[:2] == ["srun", "--jobid=77"] and "--nodelist=gpu09,gpu10" in argv and "--ntasks-per-node=1" in argv
    assert "ssh" not in argv
    assert argv[argv.index("--rdzv-endpoint") + 1] == "gpu09:29577"  # master_port 29500 + job id
    assert argv[argv.index("--rdzv-id") + 1].endswith("-slurm77-0")
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert "SLURM_CONF=/x/slurm.conf" in out  # srun finds its cluster and allocation


def test_launch_outside_an_allocation_says_to_submit(slurm_recipe: Path) -> None:
    r = slurm_ftkit("launch", str(slurm_recipe), env=clean_env(), cwd=slurm_recipe.parent)
    assert r.returncode == ExitCode.USAGE
    assert r.stderr.count("\n") == 1 and "ftkit: error:" in r.stderr and "ftkit submit" in r.stderr, r.stderr


def test_engine_auto_is_slurm_only_inside_an_allocation(write_recipe) -> None:
    recipe = write_recipe(
        """\
        model: {path: ./model}
        data: {train: ./data.jsonl}
        train: {output_dir: ./runs/a, micro_batch_size: 1, global_batch_size: 2, max_steps: 5}
        cluster: {engine: auto, gpus_per_node: 2, accelerator: cpu}
        """
    )
    inside = slurm_ftkit(
        "launch", str(recipe), "--dry-run", env=clean_env(SLURM_JOB_ID="5", SLURM_JOB_NODELIST="c1"), cwd=recipe.parent
    )
    assert inside.returncode == 0, inside.stderr
    assert "plan: slurm on 1 node(s): c1 (2)" in inside.stdout
    outside = slurm_ftkit("launch", str(recipe), "--dry-run", env=clean_env(), cwd=recipe.parent)
    assert outside.returncode == 0, outside.stderr
    assert "plan: deepspeed on 1 node(s): localhost (2)" in outside.stdout


def test_slurm_engine_with_a_hostfile_is_a_recipe_error(slurm_recipe: Path) -> None:
    (slurm_recipe.parent / "hostfile").write_text("a slots=2\nb slots=2\n")
    r = slurm_ftkit("plan", str(slurm_recipe), "cluster.hostfile=hostfile", env=clean_env(), cwd=slurm_recipe.parent)
    assert r.returncode == ExitCode.USAGE and "cluster.hostfile" in r.stderr and "allocation" in r.stderr, r.stderr


def test_submit_dry_run_shows_the_batch_script(slurm_recipe: Path) -> None:
    """--requeue, output appended, USR1 to the batch process with a lead from the measured saves, Python payload."""
    cwd = slurm_recipe.parent
    args = ("submit", str(slurm_recipe), "--dry-run", "--nodes", "2", "--time", "1:00:00", "--partition", "gpu")
    r = slurm_ftkit(*args, "--", "--qos=high", env=clean_env(), cwd=cwd)
    assert r.returncode == 0, r.stderr
    s = r.stdout
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@90",  # nothing measured yet: resilience.stop_timeout_s
        "#SBATCH --open-mode=append",
        "#SBATCH --time=1:00:00",
        "#SBATCH --partition=gpu",
    ):
        assert line in s.splitlines(), (line, s)
    assert f"exec {sys.executable} -m ftkit.run.submit batch {slurm_recipe}" in s
    assert "--qos=high" in s.splitlines()[-1]
    assert not (cwd / "runs" / "s" / "slurm" / "submit.sbatch").exists()  # --dry-run writes nothing
    # Measured saves: 2 x the slowest (7.5 s) + 30 s, still under stop_timeout_s.
    run = cwd / "runs" / "s"
    run.mkdir(parents=True)
    commits = [{"event": "commit", "step": 10, "commit_s": 2.0}, {"event": "commit", "step": 20, "commit_s": 7.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(c) + "\n" for c in commits))
    r = slurm_ftkit("submit", str(slurm_recipe), "--dry-run", env=clean_env(), cwd=cwd)
    assert "#SBATCH --signal=B:USR1@45" in r.stdout.splitlines(), r.stdout


def test_submit_without_sbatch_is_one_line(slurm_recipe: Path, tmp_path: Path) -> None:
    env = clean_env(PATH=str(tmp_path / "nothing-here"))
    r = slurm_ftkit("submit", str(slurm_recipe), env=env, cwd=slurm_recipe.parent)
    assert r.returncode == ExitCode.USAGE and r.stderr.count("\n") == 1 and "sbatch: not found" in r.stderr, r.stderr
