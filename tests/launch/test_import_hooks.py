"""The rank's import hooks (``ftkit.launch.rank``) on plain modules: a module imported with an optional library hidden
goes without it, the library is importable again right after (also when that module's import fails), and the
post-import patch of the same module still runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import REPO

PROGRAM = """
import json, sys
sys.path.insert(0, sys.argv[1])
from ftkit.launch.rank import hide_while_importing, on_import
hide_while_importing("uses_optional", ("optional_lib",))
hide_while_importing("fails_to_import", ("optional_lib",))
patched = []
on_import("uses_optional", lambda m: patched.append(m.HAS_OPTIONAL))
import uses_optional
out = {"had_it": uses_optional.HAS_OPTIONAL, "patched_with": patched, "marks_left": "optional_lib" in sys.modules}
try:
    import fails_to_import
except RuntimeError as e:
    out["failed"] = str(e)
out["marks_left_after_failure"] = "optional_lib" in sys.modules
import optional_lib
out["importable_after"] = optional_lib.VALUE
import uses_optional_too
out["others_get_it"] = uses_optional_too.HAS_OPTIONAL
print(json.dumps(out))
"""

OPTIONAL_USER = """
try:
    import optional_lib
    HAS_OPTIONAL = True
except ImportError:
    HAS_OPTIONAL = False
"""


def test_a_module_imported_with_a_library_hidden_goes_without_it_and_everyone_else_still_gets_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "optional_lib.py").write_text("VALUE = 42\n")
    (tmp_path / "uses_optional.py").write_text(OPTIONAL_USER)
    (tmp_path / "uses_optional_too.py").write_text(OPTIONAL_USER)
    (tmp_path / "fails_to_import.py").write_text(OPTIONAL_USER + "raise RuntimeError('broken module')\n")
    r = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {
        "had_it": False,
        "patched_with": [False],
        "marks_left": False,
        "failed": "broken module",
        "marks_left_after_failure": False,
        "importable_after": 42,
        "others_get_it": True,
    }
