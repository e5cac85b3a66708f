"""The real Slurm cluster of the slurm tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.slurm import SlurmCluster, slurm_cluster


@pytest.fixture(scope="module")
def slurm2() -> Iterator[SlurmCluster]:
    """A real two-node Slurm cluster (n1, n2), one per module; skips without root."""
    with slurm_cluster() as c:
        yield c
