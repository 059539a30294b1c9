"""FabricliteEnvironment: a rank started by fabriclite's own supervisor (script-mode ``launch()``, ``fabriclite run``).

The launcher imports the variable names below and fills them with :func:`child_env`; nothing else should spell them.
"""

from typing import Dict, Optional, Tuple

from fabriclite.environments._vars import all_set, read_int, read_optional_int, read_port, read_str
from fabriclite.environments.base import ClusterEnvironment

RANK_VAR = "FABRICLITE_RANK"
LOCAL_RANK_VAR = "FABRICLITE_LOCAL_RANK"
NODE_RANK_VAR = "FABRICLITE_NODE_RANK"
WORLD_SIZE_VAR = "FABRICLITE_WORLD_SIZE"
LOCAL_WORLD_SIZE_VAR = "FABRICLITE_LOCAL_WORLD_SIZE"
NUM_NODES_VAR = "FABRICLITE_NUM_NODES"
MAIN_ADDRESS_VAR = "MASTER_ADDR"
MAIN_PORT_VAR = "MASTER_PORT"
#: where this node's ranks reach the job's store when it is not the main address: their node's relay (a multi-node
#: job with a job secret, supervision/agent/job_store.py) or node 0's store on loopback
STORE_ADDRESS_VAR = "FABRICLITE_STORE_ADDR"
STORE_PORT_VAR = "FABRICLITE_STORE_PORT"
#: Forces an environment by name (read by :func:`fabriclite.environments.detect_environment`).
FORCE_VAR = "FABRICLITE_CLUSTER_ENVIRONMENT"

#: Every variable a supervisor sets in a child, in the order of :func:`child_env`'s arguments.
CHILD_VARS = (
    RANK_VAR, LOCAL_RANK_VAR, NODE_RANK_VAR, WORLD_SIZE_VAR, LOCAL_WORLD_SIZE_VAR, NUM_NODES_VAR,
    MAIN_ADDRESS_VAR, MAIN_PORT_VAR, FORCE_VAR,
)


def child_env(
    rank: int,
    local_rank: int,
    node_rank: int,
    world_size: int,
    local_world_size: int,
    num_nodes: int,
    main_address: str,
    main_port: int,
) -> Dict[str, str]:
    """The variables to add to a child's environment so that it detects :class:`FabricliteEnvironment`.

    Includes ``FABRICLITE_CLUSTER_ENVIRONMENT=fabriclite``, so the child picks this environment even inside a
    SLURM/LSF/MPI task whose variables it inherits (those count supervisors there, not ranks).
    """
    if not 0 <= rank < world_size or not 0 <= local_rank < local_world_size or not 0 <= node_rank < num_nodes:
        raise ValueError(
            f"child_env: inconsistent ranks rank={rank}/world_size={world_size}, "
            f"local_rank={local_rank}/local_world_size={local_world_size}, node_rank={node_rank}/num_nodes={num_nodes}."
        )
    if not 0 < main_port < 65536:
        raise ValueError(f"child_env: main_port={main_port} is not a TCP port (1..65535); pick one before starting.")
    values = (rank, local_rank, node_rank, world_size, local_world_size, num_nodes, main_address, main_port)
    env = {name: str(value) for name, value in zip(CHILD_VARS, values)}
    env[FORCE_VAR] = FabricliteEnvironment.name
    return env


class FabricliteEnvironment(ClusterEnvironment):
    """A rank that fabriclite's supervisor started; the supervisor hosts the rendezvous store.

    Detected when ``FABRICLITE_RANK`` and ``FABRICLITE_WORLD_SIZE`` are set. Reads ``FABRICLITE_RANK``,
    ``FABRICLITE_LOCAL_RANK``, ``FABRICLITE_NODE_RANK``, ``FABRICLITE_WORLD_SIZE`` (required) and
    ``FABRICLITE_LOCAL_WORLD_SIZE``, ``FABRICLITE_NUM_NODES`` (optional), plus ``MASTER_ADDR`` and ``MASTER_PORT``
    where the supervisor's TCPStore listens (ranks connect to it as clients: :attr:`uses_agent_store` is True).
    """

    name = "fabriclite"
    nested_launcher = True

    @classmethod
    def detect(cls) -> bool:
        return all_set((RANK_VAR, WORLD_SIZE_VAR))

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return read_str(MAIN_ADDRESS_VAR, self.name)

    @property
    def main_port(self) -> int:
        return read_port(MAIN_PORT_VAR, self.name)

    def world_size(self) -> int:
        return read_int(WORLD_SIZE_VAR, self.name, minimum=1)

    def global_rank(self) -> int:
        return read_int(RANK_VAR, self.name)

    def local_rank(self) -> int:
        return read_int(LOCAL_RANK_VAR, self.name)

    def node_rank(self) -> int:
        return read_int(NODE_RANK_VAR, self.name)

    def local_world_size(self) -> Optional[int]:
        return read_optional_int(LOCAL_WORLD_SIZE_VAR, self.name, minimum=1)

    def num_nodes(self) -> Optional[int]:
        return read_optional_int(NUM_NODES_VAR, self.name, minimum=1)

    @property
    def uses_agent_store(self) -> bool:
        return True

    @property
    def store_endpoint(self) -> Tuple[str, int]:
        """``$FABRICLITE_STORE_ADDR`` / ``_PORT`` where the supervisor set them (behind the job secret's relay),
        else the main address and port."""
        if all_set((STORE_ADDRESS_VAR, STORE_PORT_VAR)):
            return read_str(STORE_ADDRESS_VAR, self.name), read_port(STORE_PORT_VAR, self.name)
        return self.main_address, self.main_port
