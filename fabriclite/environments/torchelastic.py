"""TorchElasticEnvironment: ranks started by torchrun / ``python -m torch.distributed.run``."""

import os
from typing import Optional

from fabriclite.environments._vars import all_set, read_int, read_optional_int, read_port, read_str
from fabriclite.environments.base import ClusterEnvironment

#: What torchrun's agent sets in every worker (torch.distributed.elastic LocalElasticAgent).
_REQUIRED = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")


class TorchElasticEnvironment(ClusterEnvironment):
    """Ranks started by torchrun (torchelastic).

    Detected when ``TORCHELASTIC_RUN_ID``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``GROUP_RANK`` are all set.
    Reads ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK`` (node rank), ``LOCAL_WORLD_SIZE``,
    ``GROUP_WORLD_SIZE`` (number of nodes), ``MASTER_ADDR``, ``MASTER_PORT`` and
    ``TORCHELASTIC_USE_AGENT_STORE`` (when "True", torchrun's agent already hosts the store at
    MASTER_ADDR:MASTER_PORT, so rank 0 must connect to it rather than start one).
    """

    name = "torchelastic"
    nested_launcher = True

    @classmethod
    def detect(cls) -> bool:
        return all_set(_REQUIRED)

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return read_str("MASTER_ADDR", self.name)

    @property
    def main_port(self) -> int:
        return read_port("MASTER_PORT", self.name)

    def world_size(self) -> int:
        return read_int("WORLD_SIZE", self.name, minimum=1)

    def global_rank(self) -> int:
        return read_int("RANK", self.name)

    def local_rank(self) -> int:
        return read_int("LOCAL_RANK", self.name)

    def node_rank(self) -> int:
        return read_int("GROUP_RANK", self.name)

    def local_world_size(self) -> Optional[int]:
        return read_optional_int("LOCAL_WORLD_SIZE", self.name, minimum=1)

    def num_nodes(self) -> Optional[int]:
        """``GROUP_WORLD_SIZE``, else ``WORLD_SIZE / LOCAL_WORLD_SIZE`` when that divides evenly, else None."""
        nodes = read_optional_int("GROUP_WORLD_SIZE", self.name, minimum=1)
        if nodes is not None:
            return nodes
        per_node = self.local_world_size()
        world = self.world_size()
        if per_node is not None and world % per_node == 0:
            return world // per_node
        return None

    @property
    def uses_agent_store(self) -> bool:
        return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip() == "True"
