"""What the import tests share: running the CLI in-process, importing sources into a recipe file, the fixtures."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.paths import FIXTURES

FIX = FIXTURES / "import"


def cli(*args: str):
    """``ftkit ARGS`` in-process (click's runner); a traceback fails the test."""
    from click.testing import CliRunner

    from ftkit.cli.main import cli as main

    result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    assert not (result.exception and not isinstance(result.exception, SystemExit)), result.output
    return result


def import_to(tmp_path: Path, model_dir: Path | None, *sources: str, accept: str = "", **kw):
    """``import_configs`` of SOURCES, the recipe written to tmp_path/recipe.yaml; (result, path)."""
    from ftkit.imports import import_configs

    out = tmp_path / "recipe.yaml"
    model = str(model_dir) if model_dir is not None else None
    result = import_configs(list(sources), model=model, accept=[accept] if accept else [], out=out, **kw)
    out.write_text(result.recipe_text)
    return result, out
