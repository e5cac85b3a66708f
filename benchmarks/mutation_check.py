"""A hand-listed mutation check over the safety-critical functions: every mutant must be killed by its tests.

``python benchmarks/mutation_check.py [--list] [--only SUBSTRING]`` (``make mutation``): for each mutant below (one
plausible bug: a check deleted, a bound loosened, a pattern narrowed), a copy of the tracked tree gets that one
change, and the named fast tests run against the copy. A mutant the tests still pass is a *survivor*: a gap in the
suite. The tests first run once on the unmutated copy (they must pass there). Exit 0 when every mutant is killed, 1
when one survives, 2 when a mutant no longer applies (its text is gone from the source: update the list with the
code) or a set of tests fails without a mutant.

The functions covered are the ones the promise "no completed work lost, never a bad resume" and "secrets never
reach a record" rest on: checkpoint verification, the choice of the checkpoint to resume from, the fidelity check
after a resume, secret redaction and the run directory's owner lock. The sources are never touched (a copy per
mutant), so a run of the suite meanwhile is unaffected.

Why hand-listed instead of mutmut or cosmic-ray: those mutate every operator of a module and need the whole module's
tests per mutant (hours on 2 cores for these five modules); the mutants here are the bugs issue 41's audit planted,
plus their neighbours, each with the tests that should catch it (about two minutes in all). Left out as equivalent
mutants: each of the redactor's quoted forms of a value alone (the raw value or another form still matches).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]


VERIFY = ("tests/checkpoint/test_checkpoints.py",)
CHOOSE = ("tests/supervise/test_choose.py", "tests/supervise/test_supervise.py")
FIDELITY = ("tests/supervise/test_supervise.py",)
REDACT = ("tests/command/test_command.py",)
OWNER = ("tests/run/test_owner.py",)

MUTANTS = (
    # checkpoint verification (ftkit/checkpoint/verify.py)
    Mutant(
        "verify: a file's size is not compared",
        "ftkit/checkpoint/verify.py",
        "        if actual != size:",
        "        if False:",
        VERIFY,
    ),
    Mutant(
        "verify: checksums are not compared",
        "ftkit/checkpoint/verify.py",
        "            if actual_sum != expected:",
        "            if False:",
        VERIFY,
    ),
    Mutant(
        "verify: a commit record of another step is accepted",
        "ftkit/checkpoint/verify.py",
        "    if dir_step is not None and step != dir_step:",
        "    if False:",
        VERIFY,
    ),
    Mutant(
        "verify: a path outside the checkpoint is accepted",
        "ftkit/checkpoint/verify.py",
        '        if rel.startswith("/") or ".." in rel.split("/"):',
        "        if False:",
        VERIFY,
    ),
    Mutant(
        "verify: another world size is accepted",
        "ftkit/checkpoint/verify.py",
        "    if world_size is not None and rec_world != world_size:",
        "    if False:",
        VERIFY,
    ),
    Mutant(
        "verify: a missing listed file is ignored",
        "ftkit/checkpoint/verify.py",
        "        except FileNotFoundError:\n            return verdict(",
        "        except FileNotFoundError:\n            continue\n            return verdict(",
        VERIFY,
    ),
    # the checkpoint to resume from (ftkit/supervise/choose.py)
    Mutant(
        "choose: starting over a run whose checkpoints were complete once",
        "ftkit/supervise/choose.py",
        '    if sel.chosen is None and any(v.kind != "no_commit" for v in sel.rejected):',
        "    if False:",
        CHOOSE,
    ),
    Mutant(
        "choose: a checkpoint past train.max_steps is resumed",
        "ftkit/supervise/choose.py",
        "(sel.step or 0) > max_steps:",
        "(sel.step or 0) > max_steps + 10**9:",
        CHOOSE,
    ),
    Mutant(
        "choose: an incompatible checkpoint is skipped silently",
        "ftkit/supervise/choose.py",
        "    if incompatible:\n        v = incompatible[0]",
        "    if False:\n        v = incompatible[0]",
        CHOOSE,
    ),
    # the fidelity check after a resume (ftkit/supervise/fidelity.py)
    Mutant(
        "fidelity: an inf loss recomputed as inf matches",
        "ftkit/supervise/fidelity.py",
        "    if not (math.isfinite(a) and math.isfinite(b)):",
        "    if False:",
        FIDELITY,
    ),
    Mutant(
        "fidelity: the tolerance is ten times looser",
        "ftkit/supervise/fidelity.py",
        "            if rel > self.tolerance:",
        "            if rel > 10 * self.tolerance:",
        FIDELITY,
    ),
    Mutant(
        "fidelity: the first window after a resume is never compared",
        "ftkit/supervise/fidelity.py",
        "        if step - self.resume_step < self.logging_steps:",
        "        if step - self.resume_step < 10**9:",
        FIDELITY,
    ),
    # secret redaction (ftkit/rundir/env.py)
    Mutant(
        "redact: PASSWORD is not a secret name",
        "ftkit/rundir/env.py",
        "TOKEN|SECRET|PASSWORD|PASSWD|",
        "TOKEN|SECRET|PASSWD|",
        REDACT,
    ),
    Mutant(
        "redact: only word characters of a value are masked",
        "ftkit/rundir/env.py",
        """|[^\\s;'"]*)""\"""",
        """|\\w*)""\"""",
        REDACT,
    ),
    Mutant(
        "redact: a value is masked by name only",
        "ftkit/rundir/env.py",
        "        for form in self.forms:\n            text = text.replace(form, MASK)",
        "        for form in ():\n            text = text.replace(form, MASK)",
        REDACT,
    ),
    Mutant(
        "redact: an environment's secret is not masked by name",
        "ftkit/rundir/env.py",
        "        return {k: (MASK if is_secret(k) else self.text(v)) for k, v in env.items()}",
        "        return {k: self.text(v) for k, v in env.items()}",
        REDACT,
    ),
    # the run directory's owner lock (ftkit/run/ownership.py)
    Mutant(
        "owner: a live owner is taken over",
        "ftkit/run/ownership.py",
        '                if state == "alive":\n                    raise RunBusy',
        "                if False:\n                    raise RunBusy",
        OWNER,
    ),
    Mutant(
        "owner: an unreachable owner is taken over without --takeover",
        "ftkit/run/ownership.py",
        '                if state == "unknown" and not takeover:',
        "                if False:",
        OWNER,
    ),
    Mutant(
        "owner: a dead supervisor's running ranks are ignored",
        "ftkit/run/ownership.py",
        "                if not takeover:\n",
        "                if False:\n",
        OWNER,
    ),
)


def _copy_tree(dest: Path) -> None:
    """The tracked files (and untracked, not ignored ones) of the work tree, as they are now."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        rel = f.decode()
        src = ROOT / rel
        if not src.is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    # the package maps ftkit.launch to launch/ (setup.cfg); the copy imports from itself, not the editable install
    (dest / "ftkit" / "launch").symlink_to("../launch")


def check(m: Mutant, base: Path) -> tuple[str, float, str]:
    """'killed', 'survived' or 'stale' (the mutant's text is not in the source), seconds, the tests' last line.
    A mutant without a change (``old == new``) is the baseline: its tests must pass on the copy as it is."""
    src = (ROOT / m.path).read_text()
    if m.old and src.count(m.old) != 1:
        return "stale", 0.0, f"{m.path}: the mutated text occurs {src.count(m.old)} times, not once"
    work = Path(tempfile.mkdtemp(prefix="ftkit-mutant-", dir=base))
    try:
        shutil.copytree(base / "tree", work / "tree", symlinks=True)
        (work / "tree" / m.path).write_text(src.replace(m.old, m.new))
        assert m.old == m.new or (work / "tree" / m.path).read_text() != src
        env = {**os.environ, "PYTHONPATH": str(work / "tree"), "DS_ACCELERATOR": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *m.tests]
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=work / "tree", env=env, capture_output=True, text=True, timeout=900)
        took = time.monotonic() - t0
        last = (r.stdout.strip().splitlines() or [""])[-1]
        return ("survived" if r.returncode == 0 else "killed"), took, last
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/mutation_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", default="", help="only the mutants whose name contains this")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name}  ({m.path}; {' '.join(m.tests)})")
        return 0
    base = Path(tempfile.mkdtemp(prefix="ftkit-mutation-"))
    results: dict[str, int] = {"killed": 0, "survived": 0, "stale": 0}
    t0 = time.monotonic()
    try:
        _copy_tree(base / "tree")
        # the unmutated copy first: each set of tests passes there, so a failure below is the mutant's doing
        for tests in dict.fromkeys(m.tests for m in chosen):
            verdict, took, last = check(Mutant("baseline", chosen[0].path, "", "", tests), base)
            if verdict != "survived":
                print(f"baseline: {' '.join(tests)} fail without a mutant ({took:.0f}s): {last}")
                return 2
        for m in chosen:
            verdict, took, last = check(m, base)
            results[verdict] += 1
            print(f"{verdict:8} {took:5.1f}s  {m.name}" + (f"  [{last}]" if verdict != "killed" else ""), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"{results['killed']} killed, {results['survived']} survived, {results['stale']} stale "
        f"of {len(chosen)} mutants ({time.monotonic() - t0:.0f}s)"
    )
    if results["stale"]:
        return 2
    return 1 if results["survived"] else 0


if __name__ == "__main__":
    sys.exit(main())
