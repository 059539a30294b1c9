"""Apple MPS: a single device."""
from __future__ import annotations

import platform
from typing import Any, List

import torch

from fabriclite.accelerators.base import Accelerator
from fabriclite.accelerators.parsing import parse_indices


class MPSAccelerator(Accelerator):
    name = "mps"

    @staticmethod
    def is_available() -> bool:
        mps = getattr(torch.backends, "mps", None)
        return bool(mps and mps.is_available() and platform.processor() in ("arm", "arm64"))

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def parse_devices(devices: Any) -> List[int]:
        return parse_indices(devices, 1 if MPSAccelerator.is_available() else 0, "mps")

    @staticmethod
    def get_parallel_devices(devices: Any) -> List[torch.device]:
        return [torch.device("mps", i) for i in devices]

    def setup_device(self, device: torch.device, local_world_size: int = 1) -> None:
        if device.type != "mps":
            raise ValueError(f"MPSAccelerator got device {device}; expected an mps device.")
