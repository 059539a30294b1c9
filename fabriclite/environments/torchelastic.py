"""TorchElasticEnvironment: ranks started by torchrun / ``python -m torch.distributed.run``."""

import os
from typing import Optional

from fabriclite.environments._vars import all_set, read_int, read_optional_int
from fabriclite.environments.env_var import EnvVarEnvironment

#: What torchrun's agent sets in every worker (torch.distributed.elastic LocalElasticAgent).
_REQUIRED = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")


class TorchElasticEnvironment(EnvVarEnvironment):
    """Ranks started by torchrun (torchelastic): the env:// contract plus torchrun's own variables.

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

    def local_rank(self) -> int:
        return read_int("LOCAL_RANK", self.name)

    def node_rank(self) -> int:
        return read_int("GROUP_RANK", self.name)

    def num_nodes(self) -> Optional[int]:
        """``GROUP_WORLD_SIZE``, else ``WORLD_SIZE / LOCAL_WORLD_SIZE`` when that divides evenly, else None."""
        nodes = read_optional_int("GROUP_WORLD_SIZE", self.name, minimum=1)
        return nodes if nodes is not None else super().num_nodes()

    @property
    def uses_agent_store(self) -> bool:
        return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip() == "True"
