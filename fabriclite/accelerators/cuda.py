"""CUDA GPUs: devices are indices; each rank sets its current device."""
from __future__ import annotations

from typing import Any, List

import torch

from fabriclite.accelerators.base import Accelerator
from fabriclite.accelerators.parsing import parse_indices


class CUDAAccelerator(Accelerator):
    name = "cuda"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def auto_device_count() -> int:
        return torch.cuda.device_count()

    @staticmethod
    def parse_devices(devices: Any) -> List[int]:
        return parse_indices(devices, torch.cuda.device_count(), "cuda")

    @staticmethod
    def get_parallel_devices(devices: Any) -> List[torch.device]:
        return [torch.device("cuda", i) for i in devices]

    def setup_device(self, device: torch.device, local_world_size: int = 1) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDAAccelerator got device {device}; expected a cuda device.")
        torch.cuda.set_device(device)

    def teardown(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
