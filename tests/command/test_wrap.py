"""Wrapping a user's command, ``ftkit launch RECIPE [--no-inject] -- CMD``, without ranks: what ``--dry-run`` shows (the
command, the env contract, the hook), one-line command mistakes, a model the plan cannot read, and the launch staying
import-light. Wrapped scripts run for real: tests/integration/wrap/test_wrap.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_ftkit
from tests.helpers.paths import REPO


def _dry(recipe: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_ftkit("launch", str(recipe), "--dry-run", *args, cwd=recipe.parent, env=env)


def test_dry_run_shows_the_command_the_env_contract_and_the_hook(write_recipe, tmp_path):
    recipe = write_recipe()
    (tmp_path / "sft.py").write_text("")
    r = _dry(recipe, "--", "python", "sft.py", "--output_dir", "x", env={"PYTHONPATH": "/site"})
    assert r.returncode == 0, r.stderr
    inject = str(REPO / "launch" / "inject")
    assert f"import hook: {inject}/sitecustomize.py" in r.stdout
    assert f"PYTHONPATH={inject}:/site" in r.stdout
    run = (tmp_path / "run").resolve()
    assert f"FTKIT_RUN_DIR={run}" in r.stdout and "FTKIT_ATTEMPT=0" in r.stdout and "FTKIT_RESUME=\n" in r.stdout
    assert f"env -C {tmp_path} " in r.stdout and f"--log_level=info {tmp_path / 'sft.py'} --output_dir x" in r.stdout
    assert "data.max_seq_len" not in r.stderr and "data.train: data.* and peft.*" in r.stderr  # the keys it set
    off = _dry(recipe, "--no-inject", "--", "python", "sft.py")
    assert off.returncode == 0 and "import hook:" not in off.stdout and inject not in off.stdout
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')  # the built-in entry's data is checked, as by launch
    builtin = _dry(recipe)
    assert "ftkit.launch.train" in builtin.stdout and "import hook:" not in builtin.stdout
    assert "data.* and peft.*" not in builtin.stderr


def test_command_mistakes_exit_2_with_one_line(write_recipe, tmp_path):
    recipe = write_recipe()
    for args, text in (
        (["--"], "command: empty"),
        (["--", "python", "missing.py"], "missing.py: script not found"),
        (["--", "python", "-m", "missing_module_xyz"], "no module named 'missing_module_xyz'"),
        (["--", "python", "-m", "json.missing_xyz"], "no module named 'json.missing_xyz'"),
        (["--", "torchrun", "--nproc-per-node", "2", "x.py"], "torchrun is a launcher"),
        (["--", "accelerate", "launch", "x.py"], "accelerate is a launcher"),
    ):
        r = _dry(recipe, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert text in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_model_the_plan_cannot_read_still_launches_a_command(write_recipe, tmp_path):
    """With a user command, a model directory without config.json is not an error: the plan says what it could
    not estimate and uses DeepSpeed's default bucket sizes. The built-in entry still refuses it."""
    recipe = write_recipe(
        """\
        model:
          path: ./custom-model
        data:
          train: ./data.jsonl
        train:
          output_dir: ./run
          micro_batch_size: 2
          global_batch_size: 16
        zero:
          stage: 2
        cluster:
          gpus_per_node: 8
        """
    )
    (tmp_path / "custom-model").mkdir()
    (tmp_path / "t.py").write_text("")
    builtin = _dry(recipe)
    assert builtin.returncode == 2 and "config.json" in builtin.stderr
    r = _dry(recipe, "--", "python", "t.py")
    assert r.returncode == 0, r.stderr
    assert "could not estimate" in r.stderr and "memory and step time not estimated" in r.stderr
    from ftkit.plan.plan import build_plan
    from ftkit.recipe.load import load_recipe

    plan = build_plan(load_recipe(str(recipe), []), unknown_model_ok=True)
    assert plan.knobs["reduce_bucket_size"].value == int(5e8) and plan.unknown
    from ftkit.errors import RecipeError

    with pytest.raises(RecipeError, match="auto needs the model's config"):
        build_plan(load_recipe(str(recipe), ["zero.stage=auto"]), unknown_model_ok=True)


def test_launch_with_a_command_stays_import_light(write_recipe, tmp_path):
    recipe = write_recipe()
    (tmp_path / "sft.py").write_text("")
    code = (
        "import sys\n"
        "from ftkit.run.job import LaunchRequest, launch\n"
        f"req = LaunchRequest(recipe={str(recipe)!r}, dry_run=True, command=('python', 'sft.py'))\n"
        "launch(req, echo=lambda s: None)\n"
        "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'accelerate', 'peft', 'trl') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
