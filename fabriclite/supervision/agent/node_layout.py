"""Where one node's ranks sit in the job (``NodeLayout``), and what a supervisor needs of a started rank
(``Worker``: a process it can poll)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol


class Worker(Protocol):
    pid: int

    def poll(self) -> Optional[int]:
        """None while running, else the exit code (negative: killed by that signal)."""


@dataclass(frozen=True)
class NodeLayout:
    """Where this node's ranks sit in the job."""

    num_nodes: int
    node_rank: int
    local_world_size: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.local_world_size

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_world_size + local_rank
