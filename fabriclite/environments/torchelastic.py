"""TorchElasticEnvironment: ranks started by torchrun / ``python -m torch.distributed.run``."""

import os
import warnings
from typing import Optional

from fabriclite.environments._vars import all_set, main_address_or, main_port_or, read_int, read_optional_int
from fabriclite.environments.env_var import EnvVarEnvironment
from fabriclite.environments.process_rank import current_rank

#: What torchrun's agent sets in every worker (torch.distributed.elastic LocalElasticAgent).
_REQUIRED = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")
#: Lightning's address and port when torchrun's variables are missing
DEFAULT_ADDRESS, DEFAULT_PORT = "127.0.0.1", 12910


class TorchElasticEnvironment(EnvVarEnvironment):
    """Ranks started by torchrun (torchelastic): the env:// contract plus torchrun's own variables.

    Detected when ``TORCHELASTIC_RUN_ID``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``GROUP_RANK`` are all set:
    every torchrun worker has them. (Lightning detects ``TORCHELASTIC_RUN_ID`` alone, so a stale one left in a shell
    makes it fail on the missing ``RANK``; here such a process is an ordinary one and ``launch()`` starts the ranks.)
    Reads ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK`` (node rank, default 0), ``LOCAL_WORLD_SIZE``,
    ``GROUP_WORLD_SIZE`` (number of nodes), ``MASTER_ADDR`` / ``MASTER_PORT`` (defaults 127.0.0.1 / 12910 with a
    warning, as Lightning) and ``TORCHELASTIC_USE_AGENT_STORE`` (when "True", torchrun's agent already hosts the
    store at MASTER_ADDR:MASTER_PORT, so rank 0 must connect to it rather than start one). A missing rank variable
    is a ValueError naming it.
    """

    name = "torchelastic"
    nested_launcher = True

    @classmethod
    def detect(cls) -> bool:
        return all_set(_REQUIRED)

    @property
    def main_address(self) -> str:
        return main_address_or(lambda: _default("MASTER_ADDR", DEFAULT_ADDRESS))

    @property
    def main_port(self) -> int:
        return main_port_or(self.name, lambda: int(_default("MASTER_PORT", str(DEFAULT_PORT))))

    def local_rank(self) -> int:
        return read_int("LOCAL_RANK", self.name)

    def node_rank(self) -> int:
        return read_int("GROUP_RANK", self.name, default=0)

    def num_nodes(self) -> Optional[int]:
        """``GROUP_WORLD_SIZE``, else ``WORLD_SIZE / LOCAL_WORLD_SIZE`` when that divides evenly, else None."""
        nodes = read_optional_int("GROUP_WORLD_SIZE", self.name, minimum=1)
        return nodes if nodes is not None else super().num_nodes()

    @property
    def uses_agent_store(self) -> bool:
        return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip() == "True"


def _default(var: str, value: str) -> str:
    """``value``, with Lightning's warning on rank 0 that ``var`` is not set."""
    if current_rank() == 0:
        warnings.warn(f"{var} environment variable is not defined. Set as {value}", stacklevel=4)
    return value
