"""ftkit.cluster.pkgversions: the fast version scan agrees with importlib.metadata, in process and as the ``python -S
-c`` probe preflight sends to every host."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from ftkit.cluster.pkgversions import PACKAGES, probe_source, versions


def _importlib(names, path=None) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = next(iter(metadata.distributions(name=n, path=path))).version if path else metadata.version(n)
        except (metadata.PackageNotFoundError, StopIteration):
            out[n] = "missing"
    return out


def _probe(env_extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | (env_extra or {})
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe_source()], capture_output=True, text=True, env=env, check=True, cwd="/"
    )
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def test_in_process_scan_agrees_with_importlib_metadata() -> None:
    mine = versions()
    assert mine.pop("python") == ".".join(map(str, sys.version_info[:3]))
    assert mine == _importlib(PACKAGES)
    assert mine["torch"] != "missing" and mine["ftkit"] != "missing"


def test_the_remote_probe_without_site_finds_the_virtualenv_packages() -> None:
    """``python -S`` leaves sys.prefix at the base installation (site.venv() moves it): the scan must still find
    the virtual environment's site-packages, as the ranks (with site) will."""
    assert _probe() == versions()


def test_a_pythonpath_entry_shadows_the_installed_version_as_it_does_for_imports(tmp_path: Path) -> None:
    fake = tmp_path / "other-site"
    (fake / "torch-2.1.0.dist-info").mkdir(parents=True)
    (fake / "torch-2.1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.1.0\n")
    (fake / "Old_Pkg-1.0-py3.11.egg-info").mkdir()
    assert _probe({"PYTHONPATH": str(fake)})["torch"] == "2.1.0"
    sys.path.insert(0, str(fake))
    try:
        got = versions(("torch", "old-pkg", "surely-not-installed-anywhere"))
    finally:
        sys.path.remove(str(fake))
    assert got["torch"] == "2.1.0" == _importlib(["torch"], path=[str(fake)])["torch"]
    assert got["old-pkg"] == "1.0"
    assert got["surely-not-installed-anywhere"] == "missing"
