"""A script with a bug at import time (it never imports ftkit)."""

import transformers  # noqa: F401
from no_such_module_for_ftkit_tests import train  # noqa: F401

raise SystemExit("unreachable")
