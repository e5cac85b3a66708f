"""Fixtures shared by every test: a tiny model config on disk and a recipe writer (no heavy imports here). Plain
helpers are in tests/helpers/; the fixtures of the real runs are in tests/integration/conftest.py."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest

from tests.helpers.recipes import MINIMAL, TINY_LLAMA

_SESSION_START = __import__("time").time()

# The planner's activation profile comes from the closed form in tests (and in the runs they start), unless a test
# asks for tracing (FTKIT_PROFILE=auto with its own FTKIT_PROFILE_CACHE): a trace costs a subprocess importing torch
# and transformers (seconds), and the golden outputs must not depend on what a machine has cached.
__import__("os").environ.setdefault("FTKIT_PROFILE", "formula")
# The launches of the suite render no RUN/report.html (ftkit.report.live.REPORT_ENV): a render is a CPU-second or two
# of matplotlib per launch, and only the report's own run (tests/integration/report) reads the page a launch wrote.
__import__("os").environ.setdefault("FTKIT_REPORT", "off")


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    """Safety net for tests that start DeepSpeed directly (not through ftkit, which removes them itself): drop the
    /dev/shm buffers DeepSpeed's CPU collectives created during this session. Only where the whole session ends (the
    xdist controller, or a run without workers): a worker that finishes first would remove the buffers and local
    tiers of the runs still going on the other worker."""
    if hasattr(session.config, "workerinput"):
        return
    shm = Path("/dev/shm")
    for p in shm.glob("deepspeed_allreduce_buffer_*") if shm.is_dir() else []:
        try:
            if p.stat().st_mtime >= _SESSION_START - 1:
                p.unlink()
        except OSError:
            pass
    # ... and local checkpoint tiers a failed test left (a passing one asserts its run removed its own)
    for p in shm.glob("ftkit-*") if shm.is_dir() else []:
        try:
            if p.is_dir() and p.stat().st_mtime >= _SESSION_START - 1:
                __import__("shutil").rmtree(p, ignore_errors=True)
        except OSError:
            pass


# The integration tier runs on two pytest-xdist workers (make test: ``-n 2 --dist loadscope``): a module's tests
# stay on one worker, so its module-scoped runs are made once, and the modules whose tests use namespace hosts or the
# Slurm cluster form one unit (their hosts and daemons are machine-wide). ``pytest_collection_modifyitems`` checks
# that the list below names every such module.
HOST_MODULES = frozenset(
    {
        "tests/integration/doctor/test_doctor.py",
        "tests/integration/multinode/test_multinode.py",
        "tests/integration/multinode/test_netns_harness.py",
        "tests/integration/multinode/test_scale.py",
        "tests/integration/slurm/test_slurm.py",
        "tests/integration/stragglers/test_stragglers_multinode.py",
        "tests/integration/tiers/test_peer_copies.py",
    }
)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with the namespace-host and Slurm modules as one scope."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "namespace hosts and Slurm" if module in HOST_MODULES else module

    return ByModule(config, log)


# Variants of integration tests that `make test` (CI) leaves to `make test-extended`: what they add over the variant
# kept is another engine or another shape of the same failure, which a kept test covers for the same code path (the
# matrix cells kept cover each engine under a kill; the unit tests cover every corruption verify refuses). A CI run of
# everything took 72 minutes in the integration tier, where the budget is 40 for all of CI.
EXTENDED = (
    "tests/integration/recovery/test_recovery.py::test_sigkilled_rank_recovers_with_identical_losses[accelerate]",
    "tests/integration/recovery/test_recovery.py::test_sigkilled_rank_recovers_with_identical_losses[torchrun]",
    "tests/integration/recovery/test_recovery.py::test_corrupted_newest_checkpoint_resumes_from_older_valid_one[trainer_state]",
    "tests/integration/recovery/test_recovery.py::test_corrupted_newest_checkpoint_resumes_from_older_valid_one[latest]",
    "tests/integration/recovery/test_recovery.py::test_master_port_in_use_fails_preflight_before_anything_starts[0.0.0.0]",
    "tests/integration/recovery/test_graceful_stop.py::test_sigterm_saves_the_step_in_flight_and_the_relaunch_recomputes_nothing[accelerate]",
    "tests/integration/recovery/test_graceful_stop.py::test_sigterm_saves_the_step_in_flight_and_the_relaunch_recomputes_nothing[torchrun]",
    "tests/integration/recovery/test_graceful_stop.py::test_every_stop_signal_saves_first[SIGHUP]",
    "tests/integration/recovery/test_graceful_stop.py::test_every_stop_signal_saves_first[SIGUSR1]",
    "tests/integration/wrap/test_wrap.py::test_unmodified_hf_trainer_script_survives_a_killed_rank[accelerate]",
    "tests/integration/wrap/test_wrap.py::test_unmodified_hf_trainer_script_survives_a_killed_rank[torchrun]",
    "tests/integration/matrix/test_matrix.py::test_cell_killed_once_resumes_exactly[script-z3-none-deepspeed]",
    "tests/integration/matrix/test_matrix.py::test_cell_killed_once_resumes_exactly[trl_dpo-z3-cpu-deepspeed]",
    "tests/integration/matrix/test_matrix.py::test_cell_killed_once_resumes_exactly[ftkit_hf-z3-none-accelerate]",
    "tests/integration/matrix/test_matrix.py::test_cell_killed_once_resumes_exactly[ftkit_hf-z3-cpu-torchrun]",
    "tests/integration/train/test_train_runs.py::test_resume_from_a_checkpoint_loses_nothing[3]",
    "tests/integration/train/test_train_runs.py::test_bad_data_ends_with_one_clean_line_and_no_restart[empty]",
    "tests/integration/train/test_train_runs.py::test_bad_data_ends_with_one_clean_line_and_no_restart[wrong-fields]",
    "tests/integration/engines/test_rendered_configs_run.py::test_deepspeed_launcher_with_rendered_json[3]",
    "tests/integration/engines/test_rendered_configs_run.py::test_accelerate_launch_with_rendered_yaml[3]",
    # issue 39 (CI inside its budget) and issue 40 (the TP/SP runs it added): variants whose path another CI test
    # takes. ZeRO-1 and ZeRO-2 full fine-tuning train in every recovery test and the export tests; LoRA at ZeRO-2
    # stays; ZeRO-3's zero_to_fp32 export stays; deepspeed's two-host run stays; the shard corruption stays; the
    # built-in entry's deterministic failure stays (tests/integration/recovery), and the start-up failure's message
    # and missing-file cases
    "tests/integration/train/test_train_runs.py::test_full_and_lora_runs_train_commit_and_save_a_loadable_model[zero1]",
    "tests/integration/train/test_train_runs.py::test_full_and_lora_runs_train_commit_and_save_a_loadable_model[zero2]",
    "tests/integration/train/test_train_runs.py::test_full_and_lora_runs_train_commit_and_save_a_loadable_model"
    "[lora-zero3]",
    "tests/integration/export/test_export.py::test_full_fine_tuning_exports_prove_their_logits"
    "[zero1-2-DeepSpeed's zero_to_fp32]",
    "tests/integration/multinode/test_multinode.py::test_two_hosts_match_one_host_and_env_is_exactly_forwarded[torchrun]",
    "tests/integration/recovery/test_recovery.py::test_corrupted_newest_checkpoint_resumes_from_older_valid_one"
    "[flipped-bytes]",
    "tests/integration/wrap/test_startup_failures.py::test_a_start_up_failure_a_restart_cannot_change_stops_at_once"
    "[exit_status]",
    # measured in a local CI run of 46 min (integration): a relaunch that extends a run resumes as every relaunch in
    # tests/integration/recovery does; optimizer offload runs in the ZeRO-3 offload export and matrix cell; the
    # fall-back to durable without a peer copy is the agent-kill test's; the stop branch of a lost host is
    # ftkit.supervise.decide's unit tests'; SIGINT's graceful stop is SIGTERM's code path
    "tests/integration/train/test_train_runs.py::test_resume_from_a_checkpoint_loses_nothing[2]",
    "tests/integration/train/test_train_runs.py::test_full_and_lora_runs_train_commit_and_save_a_loadable_model"
    "[zero2-offload-optimizer]",
    "tests/integration/tiers/test_peer_copies.py::test_a_lost_host_and_its_tier_resume_from_the_peer_copy_else_from_durable"
    "[no-peer]",
    "tests/integration/multinode/test_multinode.py::test_partition_detected_by_heartbeat_then_shrink_or_stop[2]",
    "tests/integration/recovery/test_graceful_stop.py::test_every_stop_signal_saves_first[SIGINT]",
    # measured in CI at 47.5 min: an unmodified TRL script killed once and resumed exactly is the trl_dpo matrix cell
    "tests/integration/wrap/test_wrap.py::test_unmodified_trl_script_gets_the_recipe_and_survives_a_killed_rank[killed]",
    # ZeRO-3 full fine-tuning trains, commits and saves a loadable final in the ZeRO-3 export (its final is proven
    # against the live model), the FSDP2-against-ZeRO-3 test and the ZeRO-3 matrix cells
    "tests/integration/train/test_train_runs.py::test_full_and_lora_runs_train_commit_and_save_a_loadable_model[zero3]",
    # CI at 40.6 min: ZeRO-3 with parameters and optimizer offloaded trains, commits and exports (logits proven against
    # zero_to_fp32) in the ZeRO-3 offload export test, and a final/ against the live model is ZeRO-3's export test's;
    # the explicit ftkit.hf script runs clean (its resume after a kill: the loop API's and the hooked script's kill
    # tests); FSDP2's traffic is measured with resharding and accumulation, both terms of the prediction
    "tests/integration/train/test_train_runs.py::test_full_and_lora_runs_train_commit_and_save_a_loadable_model"
    "[zero3-offload-params]",
    "tests/integration/wrap/test_wrap.py::test_readme_explicit_ftkit_hf_example_with_no_inject_survives_a_killed_rank"
    "[killed]",
    "tests/integration/plan/test_fsdp2_traffic.py::test_fsdp2_collectives_per_step_equal_the_plan[False-1]",
)


# The integration tier's longest scopes first (a local CI run's durations, in test-seconds: the namespace-host and
# Slurm unit ~780, wrap ~450, ownership ~250, the local tier ~200, TP/SP ~160): the two workers take scopes in
# collection order, and a long module taken last leaves the other worker idle at the end.
LONGEST_FIRST = (
    "tests/integration/doctor/test_doctor.py",  # the first of the host unit (HOST_MODULES)
    "tests/integration/wrap/test_wrap.py",
    "tests/integration/ownership/test_ownership.py",
    "tests/integration/tiers/test_local_tier.py",
    "tests/integration/parallel/test_parallel_runs.py",
    "tests/integration/recovery/test_recovery.py",
    "tests/integration/recovery/test_graceful_stop.py",
    "tests/integration/fsdp2/test_fsdp2_runs.py",
)


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    first = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest keep their order
    extended = set(EXTENDED)
    for item in items:
        if item.nodeid in extended:
            item.add_marker(pytest.mark.extended)
        if item.get_closest_marker("multinode") or item.get_closest_marker("slurm"):
            module = item.nodeid.split("::")[0]
            if module not in HOST_MODULES:
                raise pytest.UsageError(f"{module} uses namespace hosts or Slurm: add it to HOST_MODULES in {__file__}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    """The count of skips, each reason once (required ones allowed by FTKIT_TEST_ALLOW_SKIPS marked so); and seconds
    per kind of test (slow, multinode, slurm), summed over the tests that ran: the integration tier runs them together
    on two workers, and these sums say which kind its time went to."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if not hasattr(r, "wasxfail")]
    reasons: dict[str, int] = {}
    for rep in skipped:
        reason = _skip_reason(rep)
        reason = f"{reason} [allowed by {ALLOW_SKIPS_ENV}]" if required_skip(reason) else reason
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_line(f"skipped: {len(skipped)}")
    for reason, n in sorted(reasons.items()):
        terminalreporter.write_line(f"    {n} x {reason}")
    count_file = os.environ.get("FTKIT_SKIP_COUNT_FILE")
    if count_file:
        Path(count_file).write_text(f"{len(skipped)}\n")
    spent: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            kw = getattr(rep, "keywords", None)
            if not kw or not hasattr(rep, "duration"):
                continue
            kind = next((k for k in ("slurm", "multinode", "slow") if k in kw), None)
            if kind:
                spent[kind] = spent.get(kind, 0.0) + rep.duration
    if spent:
        terminalreporter.write_line(
            "test seconds by kind (summed): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(spent.items()))
        )


# A skip that means "this machine lacks part of what the suite needs" is a failure (issue 41 point 6): a broken
# install (deepspeed, transformers, torch, accelerate, peft, matplotlib, the trackers: every importorskip guards a
# package `make install` installs), no usable network namespaces, no Slurm, no Chromium for the report's page. A
# developer's partial machine opts out by name: FTKIT_TEST_ALLOW_SKIPS=deepspeed,multinode (or =all); those stay
# skips, counted. Skips for what a machine may simply not have (a tmpfs mount in a container, /dev/full, pyenv shims,
# free loopback ports) stay skips. The summary prints the count; FTKIT_SKIP_COUNT_FILE receives it (make test).
ALLOW_SKIPS_ENV = "FTKIT_TEST_ALLOW_SKIPS"
REQUIRED_SKIPS = (
    (re.compile(r"could not import '([\w.]+)'"), None),  # pytest.importorskip: the module's top-level name
    (re.compile(r"\b(\w+) is not installed"), None),
    (re.compile(r"multinode harness unavailable"), "multinode"),
    (re.compile(r"real Slurm tests need"), "slurm"),
    (re.compile(r"needs Debian's chromium"), "chromium"),
)


def required_skip(reason: str) -> str | None:
    """The name a skip's reason makes required (a module's top-level name, ``multinode``, ``slurm``,
    ``chromium``), or None for a skip that is allowed anywhere."""
    for pattern, name in REQUIRED_SKIPS:
        m = pattern.search(reason)
        if m:
            return name or m.group(1).split(".")[0]
    return None


def allowed_skips() -> set[str]:
    return {w.strip() for w in os.environ.get(ALLOW_SKIPS_ENV, "").split(",") if w.strip()}


def _skip_reason(rep: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = rep.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_required_skip(rep: pytest.CollectReport | pytest.TestReport) -> None:
    if not rep.skipped or hasattr(rep, "wasxfail"):
        return
    reason = _skip_reason(rep)
    name = required_skip(reason)
    allowed = allowed_skips()
    if name is None or name in allowed or "all" in allowed:
        return
    rep.outcome = "failed"
    rep.longrepr = (
        f"required, not skipped: {reason}\n(a skip of a required dependency or harness fails the suite; on a "
        f"partial machine set {ALLOW_SKIPS_ENV}={name} to let it skip)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ARG001
    outcome = yield
    _fail_required_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # noqa: ARG001
    outcome = yield
    _fail_required_skip(outcome.get_result())


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


@pytest.fixture
def write_recipe(tmp_path: Path, model_dir: Path):
    """Write a recipe (YAML text, dedented) into tmp_path/recipe.yaml; model at ./model, data at ./data.jsonl (a
    one-line file, so `ftkit launch --dry-run`, which checks the data as a launch does, gets past it)."""
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text('{"text": "hello world"}\n')

    def _write(body: str = "", name: str = "recipe.yaml") -> Path:
        text = textwrap.dedent(body) if body else MINIMAL
        p = tmp_path / name
        p.write_text(text)
        return p

    return _write
