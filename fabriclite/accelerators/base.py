"""The Accelerator seam: what a device is, how many there are, and how a rank claims one."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, List

import torch


class Accelerator(ABC):
    """One kind of device (cpu, cuda, mps, xla).

    ``parse_devices`` turns the user's ``devices=`` into the number of local ranks or device indices,
    raising ValueError/TypeError that names the bad value; ``get_parallel_devices`` turns that into one
    ``torch.device`` per local rank.
    """

    #: the accelerator's name ("cpu", "cuda", "mps", "tpu"); Lightning's ``name()`` is a static method
    name: ClassVar[str] = "accelerator"

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """Whether this kind of device can be used in this process."""

    @staticmethod
    @abstractmethod
    def auto_device_count() -> int:
        """How many local ranks ``devices="auto"`` means."""

    @staticmethod
    @abstractmethod
    def parse_devices(devices: Any) -> Any:
        """Validate ``devices`` (already not "auto") and return an int count or a list of indices."""

    @staticmethod
    @abstractmethod
    def get_parallel_devices(devices: Any) -> List[torch.device]:
        """One device per local rank, from what ``parse_devices`` returned."""

    def setup_device(self, device: torch.device, local_world_size: int = 1) -> None:
        """Claim ``device`` for this process (called once per rank, after launch)."""

    def teardown(self) -> None:
        """Release what ``setup_device`` took."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
