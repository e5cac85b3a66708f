# ftkit developer entry points. `make demo` and `make test` install everything they need from a clean clone.
SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
# The pinned CPU build (a local wheel on the dev machines). Override for a GPU box, e.g. TORCH='torch==2.13.0'.
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ftkit-installed
# The suite starts hundreds of Python processes that import ftkit (every CLI test, supervisor, rank): they keep
# compiled bytecode even where the environment asks Python not to write it (PYTHONDONTWRITEBYTECODE), a quarter of
# an `ftkit` command's CPU time; pytest keeps its rewritten test modules the same way.
PYTEST := PYTHONDONTWRITEBYTECODE= DS_ACCELERATOR=cpu $(PY) -m pytest

.PHONY: install test test-fast test-slow test-multinode test-slurm test-extended test-matrix demo bench mutation gpu-check lint format templates docs clean

# pip can sit on one package for minutes (building deepspeed): a ticker keeps the output moving.
TICK = ( while sleep 20; do echo "    ... still installing ($$(date +%T))"; done ) & tick=$$!;

# pip installs with --no-compile: compiling the bytecode of every module of every package (transformers' hundreds of
# models, torch's tests) took 86 of its 133 s, one core busy; one import of what ftkit's processes import compiles
# theirs instead (35 s, 24 of it compiling), the rest when first imported (benchmarks/install_time.sh).
WARM_IMPORTS := import torch, transformers, deepspeed, accelerate, peft, datasets, matplotlib.pyplot, \
	deepspeed.launcher.launch, torch.distributed.run, accelerate.commands.launch, ftkit.cli.main; \
	from transformers import Trainer, TrainingArguments, AutoModelForCausalLM, AutoTokenizer

$(STAMP): setup.cfg pyproject.toml
	@echo "==> creating $(VENV) and installing $(TORCH) first (never the multi-GB CUDA build), then ftkit"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(TICK) $(PY) -m pip install --no-compile --progress-bar off "$(TORCH)"; rc=$$?; kill $$tick; exit $$rc
	@echo "==> installing ftkit and its dependencies (deepspeed, accelerate, transformers, peft, ...)"
	@$(TICK) $(PY) -m pip install --no-compile --progress-bar off -e ".[dev]" | \
		grep -E "^(Collecting|Building|Successfully)" ; rc=$${PIPESTATUS[0]}; kill $$tick; exit $$rc
	@echo "==> compiling the bytecode of what ftkit's processes import"
	@PYTHONDONTWRITEBYTECODE= DS_ACCELERATOR=cpu $(PY) -c "$(WARM_IMPORTS)"
	@echo "==> compiling DeepSpeed's CPU ops once (CPU Adam for offload, shared-memory comm), 1-2 minutes"
	@$(TICK) DS_ACCELERATOR=cpu $(PY) -m ftkit.launch.warmup; rc=$$?; kill $$tick; exit $$rc
	@touch $(STAMP)

install: $(STAMP)

# What CI runs, tier by tier, each with its wall time (the integration variants of tests/conftest.py EXTENDED are left
# to make test-extended): quick (in parallel), heavy (the training stack loaded, in parallel), and
# integration: the real multi-process runs (slow), two namespace hosts (multinode, root) and a real Slurm (slurm,
# root), on two workers that may each have one run going (FTKIT_TEST_RUNS=2; a test whose assertions are about time
# has the machine to itself, see tests/helpers/runs.py). A module's runs stay on one worker, and the namespace-host
# and Slurm tests share one (tests/conftest.py). Every tier runs even when an earlier one failed; the exit status is
# the first failure's. Each tier and the whole run say how many tests were skipped.
# A skip of a required dependency (deepspeed, transformers, torch, accelerate, peft, matplotlib, ...: every
# importorskip) or of a harness (the namespace hosts, Slurm, Chromium) FAILS the test, here, in CI and in plain
# pytest (tests/conftest.py). On a partial machine, let named ones skip: FTKIT_TEST_ALLOW_SKIPS=multinode,slurm
# (names: a module such as deepspeed, multinode, slurm, chromium; or all).
TIER_fast        := -n 3 -m "not slow and not multinode and not slurm and not heavy"
TIER_heavy       := -n 2 -m "heavy and not slow and not multinode and not slurm"
TIER_integration := -n 2 --dist loadscope --durations=0 --durations-min=20 -m "(slow or multinode or slurm) and not extended"
test: install
	@rc=0; total=$$(date +%s); skips=0; counted=$$(mktemp); \
	for tier in fast heavy integration; do \
		case $$tier in fast) args='$(TIER_fast)';; heavy) args='$(TIER_heavy)';; \
			integration) args='$(TIER_integration)';; esac; \
		echo "==> tier $$tier: $(PYTEST) -q $$args tests"; t0=$$(date +%s); echo 0 > $$counted; \
		eval "FTKIT_TEST_RUNS=2 FTKIT_SKIP_COUNT_FILE=$$counted $(PYTEST) -q $$args tests"; code=$$?; \
		[ $$code -eq 5 ] && code=0; n=$$(cat $$counted); skips=$$(( skips + n )); \
		echo "==> tier $$tier: $$(( $$(date +%s) - t0 )) s, exit $$code, $$n skipped"; \
		[ $$rc -eq 0 ] && rc=$$code; \
	done; rm -f $$counted; \
	echo "==> make test: $$(( $$(date +%s) - total )) s in all, exit $$rc, $$skips skipped"; exit $$rc

# The inner loop: parsing, planning, rendering, command building, every CLI error path; under a minute on 2 cores
# (these tests start no multi-process jobs, so they may share the machine; a third worker fills the time the
# fan-out tests spend waiting on ssh timeouts). Left to make test:
# multi-process runs (slow), namespace hosts (multinode), Slurm daemons (slurm) and the checks against the real
# libraries: tests that load the training stack, mlflow or matplotlib, or build the wheel (heavy).
test-fast: install
	$(PYTEST) -q -n 3 -m "not slow and not multinode and not slurm and not heavy" tests

test-slow: install
	$(PYTEST) -q -m "slow" tests

test-multinode: install
	$(PYTEST) -q -m "multinode" tests

test-slurm: install
	$(PYTEST) -q -m "slurm" tests

# Every cell of entry x ZeRO stage x optimizer offload x engine (make test runs two of the six ZeRO-3 cells of issue 22;
# FTKIT_MATRIX=pairwise a pairwise-covering set of 20).
# The integration variants make test leaves out for the CI budget (tests/conftest.py EXTENDED: other engines and
# failure shapes of tests it runs, four matrix cells); with make test, everything.
test-extended: install
	FTKIT_TEST_RUNS=2 $(PYTEST) -q -n 2 --dist loadscope --durations=20 -m extended tests

test-matrix: install
	FTKIT_MATRIX=$${FTKIT_MATRIX:-full} $(PYTEST) -q -rA --durations=0 tests/integration/matrix/test_matrix.py

demo: install
	$(PY) -m ftkit.demo

bench: install
	$(PY) benchmarks/cli_speed.py

# The hand-listed mutation check over verify, choose, fidelity, redaction and the owner lock (issue 41): every planted
# bug must fail its fast tests; a survivor is a gap in the suite. About two minutes on 2 cores.
mutation: install
	DS_ACCELERATOR=cpu $(PY) benchmarks/mutation_check.py

# On a machine with one CUDA GPU (../shared/GPU.md): every ZeRO stage, offload, LoRA and FSDP2 planned, launched, killed
# and resumed; predicted vs measured memory and step time appended to docs/accuracy.md. Without a GPU it says so and
# exits 0. Uses .venv when it exists, else $(PYTHON) with ftkit and its dependencies installed (GPU machines often
# have no network: bring the wheels). GPU_CHECK_ARGS=--rehearse runs the same flow on CPU ranks.
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Style, then the import contracts (.importlinter: the house by stage, the rank side), then the types (mypy.ini).
lint: install
	$(PY) -m ruff check ftkit launch tests benchmarks
	$(PY) -m ruff format --check ftkit launch tests benchmarks
	PYTHONPATH=. $(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

format: install
	$(PY) -m ruff format ftkit launch tests benchmarks

# Refresh the comments in the shipped templates and the generated docs after editing ftkit/recipe/schema.py.
templates: install
	$(PY) -m ftkit.recipe.scaffold templates/*.yaml

docs: install
	$(PY) -m ftkit schema --markdown > docs/recipe.md
	$(PY) -m ftkit schema > docs/recipe.schema.json

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
