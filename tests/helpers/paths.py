"""Where things are: the repository and the data the tests read by path (kept at fixed places: the library's own
tests and the README name them)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
SCRIPTS = TESTS / "scripts"  # unmodified user scripts the wrap and matrix tests launch
FIXTURES = TESTS / "fixtures"
MODEL_CONFIGS = FIXTURES / "model_configs"  # published config.json files
GOLDEN = TESTS / "golden"
