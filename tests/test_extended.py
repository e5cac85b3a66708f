"""The integration variants ``make test`` leaves to ``make test-extended`` (tests/conftest.py EXTENDED) name tests that
exist, with parameters they have: a renamed test would otherwise quietly join CI's run again or vanish from both."""

from __future__ import annotations

import re

from tests.conftest import EXTENDED
from tests.helpers.paths import REPO


def test_every_extended_variant_names_a_test_and_a_parameter_it_has():
    for nodeid in EXTENDED:
        module, _, rest = nodeid.partition("::")
        name, _, param = rest.partition("[")
        text = (REPO / module).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", text, flags=re.M), nodeid
        assert param.endswith("]") and param[:-1].split("-")[0] in text, nodeid
    assert len(set(EXTENDED)) == len(EXTENDED)
