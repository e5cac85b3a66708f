"""The README as a document: it opens with the two set-up commands, its commands cover every verb, and its ``ftkit.hf``
example is a complete script. tests/integration/readme/test_readme.py runs its commands as written.
"""

from __future__ import annotations

import re

from tests.helpers.paths import REPO
from tests.helpers.readme import readme_commands, readme_example


def test_readme_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    first = re.search(r"```sh\n(.*?)```", text, flags=re.S).group(1)
    assert [line.split("#")[0].strip() for line in first.splitlines()] == ["make demo", "make test"]
    assert text.index("```sh") < text.index("ftkit is for")


def test_readme_commands_are_covered():
    cmds = readme_commands()
    verbs = ("init", "plan", "render", "check", "explain", "doctor", "launch", "status", "report", "stop", "schema")
    for verb in verbs:
        assert any(c.startswith(f"ftkit {verb}") for c in cmds), verb


def test_readme_example_is_a_complete_script():
    code = readme_example()
    compile(code, "train.py", "exec")
    assert code.startswith("# train.py\n") and len(code.splitlines()) <= 25
    for name in ("training_arguments", "callbacks()", "resume_checkpoint()", "save_final"):
        assert f"ftkit.hf.{name}" in code, name


def test_no_merge_conflict_markers_in_the_readme_or_docs():
    """A committed merge conflict once left two definitions of exit codes 12-14 in the README (issue 36)."""
    # ours, theirs and diff3's base ("=======" alone is Markdown too)
    marker = re.compile(r"^(<{7}|>{7}|\|{7})( |$)", flags=re.M)
    files = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*") if p.is_file())]
    found = [
        f"{p.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for p in files
        for text in [p.read_text(errors="replace")]
        for m in marker.finditer(text)
    ]
    assert not found, "merge-conflict markers: " + "; ".join(found)
