"""Issue 41: the hand-listed mutation check (benchmarks/mutation_check.py, ``make mutation``) stays current: every
mutant's text occurs exactly once in its file, its change is a real change, and its tests exist. The check itself
(about two minutes) is run by ``make mutation``, not by the suite."""

from __future__ import annotations

import importlib.util
import sys

from tests.helpers.paths import REPO

spec = importlib.util.spec_from_file_location("mutation_check", REPO / "benchmarks" / "mutation_check.py")
assert spec is not None and spec.loader is not None
mc = importlib.util.module_from_spec(spec)
sys.modules["mutation_check"] = mc  # its dataclass looks its module up
spec.loader.exec_module(mc)


def test_every_mutant_still_applies_to_the_code_it_names():
    assert len(mc.MUTANTS) >= 15
    covered = {m.path for m in mc.MUTANTS}
    assert covered == {
        "ftkit/checkpoint/verify.py",
        "ftkit/supervise/choose.py",
        "ftkit/supervise/fidelity.py",
        "ftkit/rundir/env.py",
        "ftkit/run/ownership.py",
    }
    for m in mc.MUTANTS:
        src = (REPO / m.path).read_text()
        assert src.count(m.old) == 1, f"{m.name}: its text occurs {src.count(m.old)} times in {m.path}"
        assert m.new != m.old and src.replace(m.old, m.new) != src, m.name
        assert all((REPO / t).exists() for t in m.tests), m.name
    assert len({m.name for m in mc.MUTANTS}) == len(mc.MUTANTS)
