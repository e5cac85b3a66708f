"""``python -m ftkit.launch.engine MODULE ARGS``: the engine's module runs as ``python -m MODULE ARGS`` would run it
(its ``__main__``, its argv, its exit code, its signal handlers), with a rank's garbage-collector tuning."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.paths import REPO

PROGRAM = """
import atexit, gc, json, signal, sys, time
print(json.dumps({"name": __name__, "argv": sys.argv, "threshold": gc.get_threshold()}), flush=True)
atexit.register(lambda: print(json.dumps({"frozen_at_exit": gc.get_freeze_count()}), flush=True))
if sys.argv[1] == "wait":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))  # the module's own handler, as DeepSpeed's launcher has
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def _engine(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    (tmp_path / "fake_launcher.py").write_text(PROGRAM)
    return subprocess.Popen(
        [sys.executable, "-m", "ftkit.launch.engine", "fake_launcher", *args],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_module_runs_as_main_with_its_argv_and_exit_code_and_collections_deferred(tmp_path: Path) -> None:
    p = _engine(tmp_path, "3", "--flag", "x")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    first, last = (json.loads(line) for line in out.splitlines())
    assert first["name"] == "__main__" and first["argv"] == [str(tmp_path / "fake_launcher.py"), "3", "--flag", "x"]
    assert first["threshold"][2] >= 1000 * 10, first  # full collections deferred while the libraries load
    assert last["frozen_at_exit"] == 0, "the module's exit handlers run before the freeze"


def test_the_modules_signal_handler_decides_the_exit(tmp_path: Path) -> None:
    p = _engine(tmp_path, "wait")
    assert p.stdout is not None and p.stdout.readline()  # started, handler installed
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 7


def test_no_module_is_a_usage_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "ftkit.launch.engine"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "usage: python -m ftkit.launch.engine MODULE [ARGS...]"


OPTIONAL = """
import importlib.util, json
out = {}
for name in ("mlflow", "datasets", "peft"):
    try:
        __import__(name)
        out[name] = "imported"
    except ImportError:
        out[name] = "absent" if importlib.util.find_spec(name) is None else "import failed"
print(json.dumps(out))
"""


def test_an_engine_process_goes_without_the_optional_libraries_it_never_uses(tmp_path: Path) -> None:
    """DeepSpeed's autotuner imports mlflow whenever DeepSpeed is imported; an engine only starts ranks."""
    import importlib.util

    assert all(importlib.util.find_spec(n) for n in ("mlflow", "datasets", "peft")), "all are installed here"
    (tmp_path / "probe.py").write_text(OPTIONAL)
    r = subprocess.run(
        [sys.executable, "-m", "ftkit.launch.engine", "probe"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"mlflow": "absent", "datasets": "absent", "peft": "absent"}


def test_a_rank_of_the_built_in_entry_keeps_only_the_trackers_it_reports_to_and_peft_for_lora() -> None:
    from ftkit.launch.rank import unused_imports

    assert unused_imports(["none"], lora=False) == ["mlflow", "datasets", "peft"]
    assert unused_imports(None, lora=False) == ["mlflow", "datasets", "peft"]
    assert unused_imports(["wandb", "mlflow"], lora=False) == ["datasets", "peft"]
    assert unused_imports("all", lora=True) == ["datasets"]
    assert unused_imports(["all"], lora=False) == ["datasets", "peft"]
    assert unused_imports(["none"], lora=True) == ["mlflow", "datasets"]
