"""LocalEnvironment: fabriclite starts the processes itself (the fallback when nothing else is detected)."""


from fabriclite.environments._vars import main_address_or, main_port_or, read_int
from fabriclite.environments.base import ClusterEnvironment


class LocalEnvironment(ClusterEnvironment):
    """fabriclite starts the ranks itself, on this machine or one machine per ``fabriclite run --node-rank``.

    Reads: ``MASTER_ADDR`` (default ``127.0.0.1``), ``MASTER_PORT`` (default 0: the launcher picks a free port),
    ``NODE_RANK`` (default 0), ``LOCAL_RANK`` (default 0). World size and global rank are what the launcher sets
    with :meth:`set_world_size` / :meth:`set_global_rank` (defaults 1 and 0). Always detected: it is the fallback.
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
        return False

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
        """Record the world size the launcher is about to create (must be >= 1)."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"LocalEnvironment.set_world_size({size!r}): the world size must be an int >= 1.")
        self._world_size = size

    def global_rank(self) -> int:
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        """Record this process's rank, given by the launcher (must be >= 0)."""
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"LocalEnvironment.set_global_rank({rank!r}): the rank must be an int >= 0.")
        self._global_rank = rank

    def local_rank(self) -> int:
        return read_int("LOCAL_RANK", self.name, default=0)

    def node_rank(self) -> int:
        return read_int("NODE_RANK", self.name, default=0)


#: Lightning's name for the same environment.
LightningEnvironment = LocalEnvironment
