"""ParallelStrategy: the base of the strategies that run one process per device (ddp, xla, horovod), as in
Lightning (``isinstance(fabric.strategy, ParallelStrategy)`` tells a multi-process strategy from a
single-device one)."""
from __future__ import annotations

from abc import ABC
from typing import Any, Dict, List, Optional

import torch

from fabriclite.checkpoint.checkpoint_io import CheckpointIO
from fabriclite.strategies.base import Strategy


class ParallelStrategy(Strategy, ABC):
    """One process per device of ``parallel_devices`` (this node's devices, set by the connector); the data is
    sharded over every rank of the job."""

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Any = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision,
                         cluster_environment=cluster_environment)
        self.parallel_devices = parallel_devices

    @property
    def num_processes(self) -> int:
        """Processes on this node: one per parallel device (1 before the connector sets them)."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, int]:
        """Every rank of the job takes its own shard."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}
