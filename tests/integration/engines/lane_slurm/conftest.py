"""The SLURM lane's cluster: three nodes on this machine, started once for the session and stopped after
(tests/support/slurm_cluster.py). Skipped with one line where it cannot run (not root, SLURM not installed:
scripts/engines/slurm.sh --why); `make test-engine-slurm` checks that first, so in CI it runs."""
from __future__ import annotations

import os
from typing import Iterator

import pytest

from slurm_cluster import SlurmCluster, missing_tools


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        pytest.skip("the SLURM lane needs root (slurmctld / slurmd run as root): scripts/engines/slurm.sh --why")
    if missing_tools():
        pytest.skip(f"SLURM not installed (missing {missing_tools()}): run scripts/engines/slurm.sh as root")
    root = str(tmp_path_factory.mktemp("slurm-cluster"))
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
