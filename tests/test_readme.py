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
