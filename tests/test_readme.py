"""The README and docs/ as documents: the README opens with the two set-up commands and links every page; the commands
of the README and its pages cover every verb; the ``ftkit.hf`` example is a complete script; every relative link
resolves. tests/integration/readme/test_readme.py runs the commands as written.
"""

from __future__ import annotations

import re

from tests.helpers.paths import REPO
from tests.helpers.readme import NOT_RUN, PAGES, SH_BLOCK, readme_commands, readme_example, sh_blocks


def test_readme_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    first = re.search(r"```sh\n(.*?)```", text, flags=re.S).group(1)
    assert [line.split("#")[0].strip() for line in first.splitlines()] == ["make demo", "make test"]
    assert text.index("```sh") < text.index("ftkit is for")


def test_readme_commands_are_covered():
    cmds = readme_commands()
    verbs = ("init", "plan", "render", "check", "explain", "import", "doctor", "launch", "status", "report", "stop")
    verbs += ("submit", "export", "schema")
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


def test_the_readme_table_orders_the_pages_whose_commands_run():
    """tests/helpers/readme.py runs the pages' commands in the order of PAGES: the order of the README's table, which
    links every page in docs/ (a new page must be added to the table and to PAGES or NOT_RUN)."""
    text = (REPO / "README.md").read_text()
    table = text.split("\n## Commands and topics\n", 1)[1].split("\n## ", 1)[0]
    linked = list(dict.fromkeys(re.findall(r"\]\((docs/[^)#]+\.md)", table)))
    assert [p for p in linked if p not in NOT_RUN] == list(PAGES)
    pages = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    assert sorted(linked) == pages, "every page in docs/ is in the README's table"
    assert set(PAGES).isdisjoint(NOT_RUN)
    for page, why in NOT_RUN.items():
        assert not SH_BLOCK.findall((REPO / page).read_text()), f"{page} is not run ({why}) but has an sh block"


def test_every_page_continues_the_tour_in_order():
    """The tour's blocks come first, the pages' after; the import block is on the configs page (tests/imports)."""
    files = [f for f, _ in sh_blocks()]
    assert files[0] == "README.md" and files == sorted(files, key=["README.md", *PAGES].index)
    assert any(f == "docs/configs.md" and "ftkit import" in b for f, b in sh_blocks())
    cmds = readme_commands()
    assert cmds.index("ftkit init myjob --template cpu-demo --force") < cmds.index("ftkit render myjob/recipe.yaml")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped (not '-' or '_'), spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        a = _anchor(heading)
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


def test_every_relative_link_resolves():
    """Every relative link of README.md and docs/*.md names an existing file, and every #anchor a heading there."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for path in files:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # no links in code blocks
        text = re.sub(r"`[^`\n]*`", "", text)  # nor in code spans
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            where = (path.parent / name).resolve() if name else path
            where_ok = where.exists()
            if not where_ok or (anchor and (where.suffix != ".md" or anchor not in _anchors(where))):
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, "broken links: " + "; ".join(broken)


def test_the_anchor_rule():
    assert _anchor("On Slurm: `ftkit submit`") == "on-slurm-ftkit-submit"
    assert _anchor("Rendering configs, and keeping checked-in copies in sync") == (
        "rendering-configs-and-keeping-checked-in-copies-in-sync"
    )
    assert _anchor("Wrapping a user's script") == "wrapping-a-users-script"


def test_every_source_file_the_readme_and_docs_name_exists():
    """A page that names `ftkit/memory.py` after the file moved to ftkit/plan/ sends a reader nowhere."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    pattern = re.compile(r"`((?:ftkit|launch|tests|benchmarks)/[A-Za-z0-9_/.-]*\.py)`")
    missing = [
        f"{p.relative_to(REPO)}:{n}: {name}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for name in pattern.findall(line)
        if not (REPO / name).exists()
    ]
    assert not missing, missing
