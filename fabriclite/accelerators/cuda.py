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


def find_usable_cuda_devices(num_devices: int = -1) -> List[int]:
    """Indices of visible CUDA devices that accept a tensor now (a GPU in exclusive mode held by another
    process does not), the first ``num_devices`` of them (-1: all usable ones). For ``Fabric(devices=...)``.

    ValueError when ``num_devices`` exceeds the visible devices (or none is visible); RuntimeError when fewer
    than ``num_devices`` are usable. Two processes calling this at once may both pick the same free GPU.
    """
    if num_devices == 0:
        return []
    visible = list(range(torch.cuda.device_count()))
    if not visible:
        raise ValueError(f"find_usable_cuda_devices({num_devices}): there are no visible CUDA devices on this "
                         "machine (check CUDA_VISIBLE_DEVICES and the driver).")
    if num_devices > len(visible):
        raise ValueError(f"find_usable_cuda_devices({num_devices}): this machine has only {len(visible)} visible "
                         f"GPU(s); ask for at most {len(visible)} or -1 for all usable ones.")
    usable: List[int] = []
    busy: List[int] = []
    for index in visible:
        try:
            torch.tensor(0, device=torch.device("cuda", index))
        except RuntimeError:
            busy.append(index)
            continue
        usable.append(index)
        if len(usable) == num_devices:
            break
    if num_devices != -1 and len(usable) != num_devices:
        raise RuntimeError(f"find_usable_cuda_devices({num_devices}): only {len(usable)} GPU(s) are usable now; "
                           f"devices {busy} are occupied by other processes.")
    return usable
