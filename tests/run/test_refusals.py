"""What `ftkit launch` (and `--dry-run`, which must exit as the launch would) refuses before anything starts."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import run_ftkit


def _recipe(write_recipe, tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    return write_recipe(
        f"""\
        model:
          path: ./model
        data:
          train: ./data.jsonl
        {extra}
        train:
          output_dir: ./run
          micro_batch_size: 2
          global_batch_size: 4
          max_steps: 4
        cluster:
          gpus_per_node: 2
          accelerator: cpu
        """
    )


def test_a_missing_eval_file_is_refused_before_anything_starts(write_recipe, tmp_path: Path) -> None:
    """data.eval used to be found missing only by every rank, after its start-up."""
    recipe = _recipe(write_recipe, tmp_path, "  eval: ./missing-eval.jsonl")
    for extra in ([], ["--dry-run"]):
        r = run_ftkit("launch", str(recipe), *extra, cwd=tmp_path)
        assert r.returncode == 2, (extra, r.stdout, r.stderr)
        assert "data.eval" in r.stderr and "missing-eval.jsonl: file not found" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "run" / "ftkit").exists()
