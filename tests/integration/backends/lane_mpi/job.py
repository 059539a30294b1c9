"""A fabriclite script for the MPI lane: ``mpirun --allow-run-as-root --oversubscribe -np N python job.py OUT``.

No code here mentions MPI: ``Fabric()`` must find the ranks in Open MPI's environment and join over gloo.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checks  # noqa: E402
from fabriclite import Fabric  # noqa: E402


@checks.check
def mpi_environment(fabric: Fabric, out: str) -> None:
    env = fabric.strategy.cluster_environment
    assert type(env).__name__ == "MPIEnvironment", env
    assert fabric.strategy.name == "ddp" and fabric.strategy.launcher is None
    assert fabric.world_size == int(os.environ["OMPI_COMM_WORLD_SIZE"])
    assert fabric.global_rank == int(os.environ["OMPI_COMM_WORLD_RANK"])
    assert fabric.local_rank == int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    assert fabric.num_nodes == 1 and fabric.node_rank == 0
    assert env.main_address == "127.0.0.1", env.main_address
    ports = fabric.strategy.all_gather_object(env.main_port)
    assert len(set(ports)) == 1, ports


if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu")
    fabric.launch()
    checks.run(fabric, ["mpi_environment", *checks.ALL], sys.argv[1])
