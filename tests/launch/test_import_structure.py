"""transformers' lazy import table, kept by a rank between processes (ftkit.launch.rank._remember_import_structure):
served from ~/.cache/ftkit while the folder's .py files are unchanged, built anew when one changes."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ftkit.launch.rank import _remember_import_structure
from tests.helpers.paths import REPO


def _scanner(calls: list[str]) -> types.ModuleType:
    """A stand-in for transformers.utils.import_utils: its table is every name each file's __all__ lists."""
    mod = types.ModuleType("import_utils")

    def define_import_structure(module_path: str, prefix: str | None = None) -> dict:
        calls.append(str(module_path))
        table: dict[str, set[str]] = {}
        folder = Path(module_path) if Path(module_path).is_dir() else Path(module_path).parent
        for f in sorted(folder.glob("*.py")):
            names: dict = {}
            exec(f.read_text(), names)  # noqa: S102 (this test's own files)
            table[f"{prefix}.{f.stem}"] = set(names.get("__all__", []))
        return {frozenset(): table}

    mod.define_import_structure = define_import_structure  # type: ignore[attr-defined]
    return mod


def test_the_table_comes_from_the_cache_until_a_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    models = tmp_path / "models"
    models.mkdir()
    (models / "a.py").write_text("__all__ = ['A']\n")
    (models / "b.py").write_text("__all__ = ['B', 'C']\n")
    calls: list[str] = []

    def process() -> types.ModuleType:
        """What a new rank process has: the module, patched once (a second patch is a no-op)."""
        mod = _scanner(calls)
        _remember_import_structure(mod)
        _remember_import_structure(mod)
        return mod

    want = {frozenset(): {"models.a": {"A"}, "models.b": {"B", "C"}}}
    first = process()
    assert first.define_import_structure(models, prefix="models") == want
    assert first.define_import_structure(models, prefix="models") is first.define_import_structure(models, "models")
    assert len(calls) == 1  # once per process, as transformers' lru_cache
    assert process().define_import_structure(models, prefix="models") == want
    assert len(calls) == 1  # the next process read it from ~/.cache/ftkit
    assert len(list((tmp_path / "cache" / "ftkit").glob("transformers-import-structure-*.marshal"))) == 1

    (models / "b.py").write_text("__all__ = ['B', 'C', 'D']\n")  # an edit (size changes): scanned again
    assert process().define_import_structure(models, prefix="models")[frozenset()]["models.b"] == {"B", "C", "D"}
    (models / "e.py").write_text("__all__ = []\n")  # a new file: scanned again
    assert "models.e" in process().define_import_structure(models, prefix="models")[frozenset()]
    assert len(calls) == 3
    assert process().define_import_structure(models, prefix="other") is not None and len(calls) == 4  # another key

    # a model package's own file (transformers passes its __file__): kept too, checked against its folder
    assert process().define_import_structure(models / "a.py", prefix="x")[frozenset()]["x.a"] == {"A"}
    assert process().define_import_structure(models / "a.py", prefix="x")[frozenset()]["x.a"] == {"A"}
    assert len(calls) == 5
    # a cache it cannot read is only the scan again
    for f in (tmp_path / "cache" / "ftkit").iterdir():
        f.write_bytes(b"\x00garbage")
    assert process().define_import_structure(models, prefix="models")[frozenset()]["models.e"] == set()
    assert len(calls) == 6


PROGRAM = """
import hashlib, sys
from ftkit.launch.rank import _remember_import_structure, on_import
on_import("transformers.utils.import_utils", _remember_import_structure)
import transformers
from transformers import AutoConfig, LlamaForCausalLM  # a real class through the table
print("names:", hashlib.sha256(" ".join(sorted(dir(transformers))).encode()).hexdigest(), flush=True)
"""


@pytest.mark.heavy  # imports transformers twice in subprocesses (seconds)
def test_real_transformers_gets_the_same_table_from_the_cache(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    said, written = [], []
    for _ in range(2):  # the first builds the table and keeps it, the second loads it
        r = subprocess.run(
            [sys.executable, "-c", PROGRAM], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
        )
        assert r.returncode == 0, r.stderr[-2000:]
        said.append(next(x for x in r.stdout.splitlines() if x.startswith("names:")))
        kept = (tmp_path / "cache" / "ftkit").glob("transformers-import-structure-*.marshal")
        written.append(sorted((f.name, f.stat().st_mtime_ns) for f in kept))
    assert said[0] == said[1]  # every name transformers offers, the same from the scan and from the cache
    assert written[0] and written[0] == written[1]  # the second process read them, wrote nothing
