"""Tier 0: the house keeps its structure. The import contracts hold (``.importlinter``), no module imports an ftkit
module from inside a function (such imports hid import cycles), no module-level import cycle exists, ``ftkit/`` has
only its few flat modules, no comment points at a design document the repository does not have, and the rank side
restates no default of a recipe value."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("ftkit", "launch")  # launch/ is shipped as ftkit.launch
FLAT_MODULES = {"__init__", "__main__", "errors", "hf", "demo"}


def _sources() -> list[Path]:
    return sorted(p for root in FIRST_PARTY for p in (REPO / root).rglob("*.py"))


def _first_party(name: str) -> bool:
    return name.split(".")[0] in FIRST_PARTY


def test_import_contracts_hold():
    lint_imports = Path(sys.executable).parent / "lint-imports"  # import-linter, in the dev extra
    r = subprocess.run(
        [str(lint_imports), "--no-cache", "--no-logo"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _function_local_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function (methods and nested functions too); relative imports are
    named with their dots."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                out += [(node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                out.append((node.lineno, "." * node.level + (node.module or "")))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, (ast.Attribute, ast.Name))
                and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
                in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                out.append((node.lineno, node.args[0].value))
    return out


def test_no_function_local_import_of_ftkit():
    """Imports inside functions are for the heavy stack (torch, transformers, ...) or the standard library only: a
    function-local ftkit import is how an import cycle hides from the module graph."""
    found = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for line, module in _function_local_imports(tree):
            if module.startswith(".") or _first_party(module):
                found.append(f"{path.relative_to(REPO)}:{line}: {module}")
    assert not found, "function-local imports of ftkit modules (import them at module level):\n" + "\n".join(found)


def _rank_side_imports(graph: grimp.ImportGraph) -> set[tuple[str, str]]:
    """(importer, imported) for the module-level imports of ``ftkit.launch.*``: launch/ is installed as ftkit.launch,
    which grimp cannot see from the source tree (there is no ftkit/launch), so those edges are added as launch.*."""
    edges = set()
    for path in _sources():
        rel = path.relative_to(REPO).with_suffix("")
        importer = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if importer not in graph.modules:
            continue  # not a module of the packages (launch/inject/sitecustomize.py)
        for node in ast.parse(path.read_text(), str(path)).body:  # module level
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] or [node.module]
            for name in names:
                if name == "ftkit.launch" or name.startswith("ftkit.launch."):
                    target = name.removeprefix("ftkit.")
                    while target not in graph.modules:  # from ftkit.launch.rank import on_import -> launch.rank
                        target = target.rpartition(".")[0]
                    edges.add((importer, target))
    return edges


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected group of modules (Tarjan's algorithm)."""
    imports = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in imports[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            groups.append([v, *group])

    for v in imports:
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:
        a = group[0]
        b = next((w for w in imports[a] if w in group), None)
        if b is None:
            continue  # a module on its own, importing nothing of its group
        back = graph.find_shortest_chain(importer=b, imported=a) if b != a else (a,)
        cycles.append([a, *(back or (b, a))])
    return cycles


def test_no_import_cycle():
    """No cycle among module-level imports (imports under ``if TYPE_CHECKING:`` do not run, so they do not count)."""
    sys.path.insert(0, str(REPO))
    try:
        graph = grimp.build_graph(*FIRST_PARTY, exclude_type_checking_imports=True, cache_dir=None)
    finally:
        sys.path.remove(str(REPO))
    for importer, imported in _rank_side_imports(graph):
        graph.add_import(importer=importer, imported=imported)
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_few_flat_modules():
    flat = {p.stem for p in (REPO / "ftkit").glob("*.py")}
    assert flat <= FLAT_MODULES, (
        f"new flat modules in ftkit/ (put them in the folder of their stage): {flat - FLAT_MODULES}"
    )


# References to DESIGN.md, which is not in the repository: every comment now points at a section of docs/design.md
# ("docs/design.md, <Section name>"). The allowance per file is empty; a new "DESIGN §N" anywhere fails.
DESIGN_REFERENCES_LEFT: dict[str, int] = {}


def test_no_new_reference_to_a_missing_design_document():
    pattern = re.compile(r"DESIGN(\.md)? ?§")
    over = []
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        lines = [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
        if len(lines) > DESIGN_REFERENCES_LEFT.get(rel, 0):
            over += lines
    assert not over, "comments that refer to DESIGN § (a file not in the repository; say it here instead):\n" + (
        "\n".join(over)
    )


def test_no_package_name_is_shadowed_by_its_own_submodule():
    """``from ftkit.checkpoint.verify import verify`` in a package with a submodule named ``verify``: importing that
    submodule later rebinds the package's name to the module, and a call fails only at run time."""
    clashes = []
    for init in sorted((REPO / "ftkit").glob("*/__init__.py")):
        name = f"ftkit.{init.parent.name}"
        package = importlib.import_module(name)
        for node in ast.parse(init.read_text()).body:
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module != name):
                continue
            source = importlib.import_module(node.module)
            for alias in node.names:
                bound = alias.asname or alias.name
                if getattr(package, bound, None) is not getattr(source, alias.name, None):
                    clashes.append(f"{init.relative_to(REPO)}:{node.lineno}: {name}.{bound} is not what it imported")
    assert not clashes, "\n".join(clashes)


# The rank-side modules that patch third-party methods and forward their *args/**kwargs verbatim (and read wandb's
# protobuf records, whose class is generated at import): the only homes of ``Any`` (mypy.ini says the same).
ANY_ALLOWED = {"launch/callback.py", "launch/hook.py", "launch/rank.py", "launch/services.py", "launch/trackers.py"}


def _any_uses(tree: ast.Module) -> list[int]:
    """Lines that name ``typing.Any`` (``Any``, ``typing.Any``, or inside a string annotation)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "Any":
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "Any" and isinstance(node.value, ast.Name):
            lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"\bAny\b[\],]", node.value):
            lines.append(node.lineno)
    return lines


def test_any_only_where_a_third_party_type_is_unknowable():
    """The library names no ``Any`` outside :data:`ANY_ALLOWED`; JSON on disk has its records (ftkit.rundir.records)
    and the heavy stack its real types under ``TYPE_CHECKING``. mypy enforces the same in ``make lint``
    (``disallow_any_explicit``, ``disallow_any_generics``, ``check_untyped_defs``); this keeps the rule in CI."""
    found = []
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        if rel in ANY_ALLOWED:
            continue
        found += [f"{rel}:{line}" for line in _any_uses(ast.parse(path.read_text(), rel))]
    assert not found, "Any outside the allowed modules (give the value its type):\n" + "\n".join(found)
    config = (REPO / "mypy.ini").read_text()
    for flag in ("disallow_any_explicit = True", "disallow_any_generics = True", "check_untyped_defs = True"):
        assert flag in config, f"mypy.ini lost {flag}"


# What the ranks read of the spec: names along an expression's chain that make it a recipe value (the spec itself,
# its local tier, its TrainingArguments, the raw recipe and its sections as the spec once carried them).
SPEC_CHAIN = {"spec", "tier", "local_tier", "training_args", "recipe", "section", "resilience"}
# Methods that read the raw recipe by string (the spec once had them): no rank-side code calls them.
RAW_RECIPE_READERS = {"section", "resilience"}


def _chain(node: ast.expr) -> set[str]:
    """The names and attributes along ``node``'s receiver chain (``r.spec.training_args.get`` -> r, spec,
    training_args, get); calls and subscripts are walked through to what they are called or indexed on."""
    out: set[str] = set()
    while True:
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            out.add(node.id)
            return out
        else:
            return out


def _literal(node: ast.expr) -> bool:
    return isinstance(node, (ast.Constant, ast.List, ast.Dict, ast.Tuple, ast.Set))


def rank_side_defaults(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, code)`` of every place that restates a default for a value of the spec: ``.get(key, default)`` or
    ``x or <literal>`` on a spec value, and every call of a raw-recipe reader (``spec.section(...)``,
    ``spec.resilience("key", default)``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = _chain(node.func.value)
            if node.func.attr == "get" and receiver & SPEC_CHAIN and (len(node.args) > 1 or node.keywords):
                out.append((node.lineno, ast.unparse(node)))
            elif node.func.attr in RAW_RECIPE_READERS:
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and _literal(node.values[-1]):
            if any(_chain(v) & SPEC_CHAIN for v in node.values[:-1]):
                out.append((node.lineno, ast.unparse(node)))
    return out


def test_the_rank_restates_no_default_of_a_recipe_value():
    """The spec carries every value resolved on the head (issue 39, point 1): the rank side (``launch/``,
    ``ftkit.hf`` and what it may import, ``ftkit/rundir/``, ``ftkit/checkpoint/``, ``ftkit/cluster/``) reads
    attributes, never a recipe value by string with its default restated (two defaults drift apart: the rank's 60 s
    against the schema's)."""
    found = []
    below = [p for d in ("rundir", "checkpoint", "cluster") for p in (REPO / "ftkit" / d).rglob("*.py")]
    for path in [*(REPO / "launch").rglob("*.py"), REPO / "ftkit" / "hf.py", *below]:
        rel = path.relative_to(REPO).as_posix()
        found += [f"{rel}:{line}: {code}" for line, code in rank_side_defaults(ast.parse(path.read_text(), rel))]
    assert not found, "a rank-side default of a recipe value (resolve it into RunSpec instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "code",
    [  # what the rank side read before the spec carried resolved values
        'timeout = float(r.spec.resilience("orphan_timeout_s", 60.0))',
        'backend = str(self.section("train").get("backend") or "deepspeed")',
        'keep = int(tier.get("keep") or 2)',
        'max_steps = int(r.spec.training_args.get("max_steps") or 0)',
        'ssh = self.tier.get("ssh_config", None)',
        'template = str((spec.local_tier or {})["dir"])',
    ],
)
def test_the_default_check_sees_the_old_reads(code):
    assert rank_side_defaults(ast.parse(code)), code


def test_every_folder_has_a_face():
    """Each package's ``__init__.py`` says what the folder offers (issue 39): a docstring, and where the folder's
    face is its modules (nothing imported there, so importing the folder costs nothing), ``__all__`` names each one."""
    faceless, stale = [], []
    for init in sorted((REPO / "ftkit").glob("*/__init__.py")):
        tree = ast.parse(init.read_text())
        if not ast.get_docstring(tree):
            faceless.append(str(init.relative_to(REPO)))
        if any(isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)) for n in tree.body):
            continue  # a folder whose face is what its __init__ defines or re-exports (render, export, ...)
        assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if t.id}
        names = ast.literal_eval(assigned["__all__"]) if "__all__" in assigned else None
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__")
        if names != modules:
            stale.append(f"{init.relative_to(REPO)}: __all__ {names} is not the folder's modules {modules}")
    assert not faceless and not stale, faceless + stale
