"""LocalEnvironment: the fallback when nothing else is detected: fabriclite starts the ranks, or they were started
by hand with ``LOCAL_RANK`` set (Lightning's LightningEnvironment)."""

import os

from fabriclite.environments._vars import main_address_or, main_port_or, read_int, read_optional_int
from fabriclite.environments.base import ClusterEnvironment
from fabriclite.environments.process_rank import set_rank


class LocalEnvironment(ClusterEnvironment):
    """Ranks on this machine, or one machine per ``fabriclite run --node-rank``: started by fabriclite, or by hand.

    As Lightning's LightningEnvironment: with ``LOCAL_RANK`` set the processes were started by hand (every rank
    with ``LOCAL_RANK``, ``NODE_RANK`` and the same ``MASTER_ADDR`` / ``MASTER_PORT``), so ``launch()`` only joins;
    without it fabriclite starts them. Reads: ``MASTER_ADDR`` (default ``127.0.0.1``), ``MASTER_PORT`` (default 0:
    the launcher picks a free port; required for ranks started by hand), ``NODE_RANK`` (else ``GROUP_RANK``, else
    0; ``fabriclite run --node-rank``), ``LOCAL_RANK`` (default 0). World size and global rank are what the
    connector sets with :meth:`set_world_size` / :meth:`set_global_rank` from ``devices`` and ``num_nodes``
    (defaults 1 and 0). Always detected: it is the fallback.
    """

    name = "local"

    def __init__(self) -> None:
        self._world_size = 1
        self._global_rank = 0

    @classmethod
    def detect(cls) -> bool:
        """Always True: used when no other environment is detected."""
        return True

    @property
    def creates_processes_externally(self) -> bool:
        """True when ``LOCAL_RANK`` is set: the ranks were started by hand (Lightning's rule)."""
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        return main_address_or(lambda: "127.0.0.1")

    @property
    def main_port(self) -> int:
        """``MASTER_PORT``, or 0 when unset: the launcher then picks a free port."""
        return main_port_or(self.name, lambda: 0)

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        """Record the world size of the job (``devices * num_nodes``; must be >= 1)."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"LocalEnvironment.set_world_size({size!r}): the world size must be an int >= 1.")
        self._world_size = size

    def global_rank(self) -> int:
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        """Record this process's rank (must be >= 0); ``rank_zero_only.rank`` follows it, as in Lightning."""
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"LocalEnvironment.set_global_rank({rank!r}): the rank must be an int >= 0.")
        self._global_rank = rank
        set_rank(rank)

    def local_rank(self) -> int:
        return read_int("LOCAL_RANK", self.name, default=0)

    def node_rank(self) -> int:
        var = "NODE_RANK" if os.environ.get("NODE_RANK", "").strip() else "GROUP_RANK"
        return read_int(var, self.name, default=0)

    def validate(self, devices: int, num_nodes: int) -> None:
        """For ranks started by hand: ValueError when ``MASTER_PORT`` is unset (each rank would pick its own port
        and wait forever), or when ``WORLD_SIZE`` is set and differs from ``devices * num_nodes``."""
        if not self.creates_processes_externally:
            return
        if not os.environ.get("MASTER_PORT", "").strip():
            raise ValueError(
                f"LOCAL_RANK={os.environ['LOCAL_RANK']!r} is set, so this process is one of ranks started by hand, "
                "which meet at MASTER_ADDR:MASTER_PORT; but MASTER_PORT is not set. Set MASTER_PORT (and MASTER_ADDR "
                "when the ranks span machines) to the same value for every rank, or unset LOCAL_RANK to have "
                "fabric.launch() start the ranks.")
        world = read_optional_int("WORLD_SIZE", self.name, minimum=1)
        if world is not None and world != devices * num_nodes:
            raise ValueError(
                f"Fabric(devices={devices}, num_nodes={num_nodes}) makes {devices * num_nodes} ranks, but WORLD_SIZE="
                f"{world} is set for these ranks started by hand (LOCAL_RANK is set). Pass devices and num_nodes "
                f"whose product is {world}, or fix WORLD_SIZE.")


#: Lightning's name for the same environment.
LightningEnvironment = LocalEnvironment
