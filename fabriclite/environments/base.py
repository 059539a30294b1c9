"""The ``ClusterEnvironment`` interface: where this process's rank, world and main address come from."""

import logging
from abc import ABC, abstractmethod
from typing import ClassVar, Optional, Tuple

log = logging.getLogger(__name__)


class ClusterEnvironment(ABC):
    """Answers who this process is in the job: world size, ranks, node, and where rank 0's store listens.

    Rank readers look at ``os.environ`` each time they are called, so an object built before a launch answers
    for the process it is asked in. Nothing here writes to ``os.environ``. A missing or malformed variable raises
    ValueError naming the variable and its value.
    """

    #: Short name, used by ``FABRICLITE_CLUSTER_ENVIRONMENT=<name>`` and in messages (subclasses set their own).
    name: ClassVar[str] = "custom"

    #: True for launchers that may themselves run inside a scheduler's task (torchrun, fabriclite's supervisor):
    #: the scheduler's variables then count launchers, not ranks, so detection does not cross-check such a winner.
    nested_launcher: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def detect(cls) -> bool:
        """True when ``os.environ`` says this process was started by this environment. Cheap, no side effects."""

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """True when every rank already exists (started by someone else), so ``launch()`` only joins."""

    @property
    @abstractmethod
    def main_address(self) -> str:
        """Host of rank 0's rendezvous store, reachable from every rank."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """Port of rank 0's rendezvous store; 0 means "not given: pick a free one" (only LocalEnvironment)."""

    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the job, across all nodes."""

    @abstractmethod
    def global_rank(self) -> int:
        """This process's rank in ``range(world_size())``."""

    @abstractmethod
    def local_rank(self) -> int:
        """This process's rank among the ranks on its node."""

    @abstractmethod
    def node_rank(self) -> int:
        """Index of this process's node in the job."""

    def local_world_size(self) -> Optional[int]:
        """Number of ranks on this node when the environment says so, else None."""
        return None

    def num_nodes(self) -> Optional[int]:
        """Number of nodes in the job when the environment says so: by default ``world_size() /
        local_world_size()`` when the local size is known and divides the world, else None."""
        per_node = self.local_world_size()
        if per_node is None:
            return None
        world = self.world_size()
        return None if world % per_node else world // per_node

    def set_world_size(self, size: int) -> None:
        """Ignored (logged at debug level): an externally created world cannot be resized."""
        log.debug("%s.set_world_size(%r) ignored: the environment sets the world size.", type(self).__name__, size)

    def set_global_rank(self, rank: int) -> None:
        """Ignored (logged at debug level): an externally created rank cannot be changed."""
        log.debug("%s.set_global_rank(%r) ignored: the rank comes from the environment.", type(self).__name__, rank)

    @property
    def uses_agent_store(self) -> bool:
        """True when a supervisor already hosts the TCPStore at main_address:main_port and every rank, rank 0
        included, connects to it as a client."""
        return False

    @property
    def store_endpoint(self) -> Tuple[str, int]:
        """Where a rank connects to the supervisor's store when :attr:`uses_agent_store`: the main address and
        port unless the environment says otherwise."""
        return self.main_address, self.main_port

    def validate(self, devices: int, num_nodes: int) -> None:
        """Check ``Fabric(devices=..., num_nodes=...)`` against a world created outside fabriclite.

        Raises ValueError, naming both numbers, the environment's world size and the fix, when
        ``devices * num_nodes`` differs from ``world_size()``, or ``devices`` from ``local_world_size()`` where
        the environment knows it. Environments where fabriclite starts the processes accept anything.
        """
        if not self.creates_processes_externally:
            return
        world = self.world_size()
        per_node = self.local_world_size()
        if per_node is not None and world % per_node == 0:
            hint = f"devices={per_node}, num_nodes={world // per_node}"
        else:
            hint = f"devices and num_nodes whose product is {world}"
        fix = f'Pass {hint}, or devices="auto" to take them from the environment.'
        if devices * num_nodes != world:
            raise ValueError(
                f"Fabric(devices={devices}, num_nodes={num_nodes}) asks for {devices} * {num_nodes} = "
                f"{devices * num_nodes} processes, but the {self.name} environment started a world of {world}. {fix}"
            )
        if per_node is not None and devices != per_node:
            raise ValueError(
                f"Fabric(devices={devices}, num_nodes={num_nodes}) asks for {devices} processes per node, but the "
                f"{self.name} environment started {per_node} on this node (world size {world}). {fix}"
            )

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Lightning's name for :meth:`validate`."""
        self.validate(num_devices, num_nodes)

    def teardown(self) -> None:
        """Release what the environment set up; the built-in environments hold nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
