"""CPU: one process per ``devices``, intra-op threads split so ranks do not oversubscribe the cores."""
from __future__ import annotations

import os
from typing import Any, List

import torch

from fabriclite.accelerators.base import Accelerator
from fabriclite.accelerators.parsing import parse_count


def available_cores() -> int:
    """Cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class CPUAccelerator(Accelerator):
    name = "cpu"

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def parse_devices(devices: Any) -> int:
        return parse_count(devices, "cpu")

    @staticmethod
    def get_parallel_devices(devices: Any) -> List[torch.device]:
        return [torch.device("cpu")] * int(devices)

    def setup_device(self, device: torch.device, local_world_size: int = 1) -> None:
        """Raise a ValueError for a non-CPU device; use max(1, cores // local ranks) threads unless
        OMP_NUM_THREADS is set."""
        if device.type != "cpu":
            raise ValueError(f"CPUAccelerator got device {device}; expected a cpu device.")
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, available_cores() // max(1, local_world_size)))
