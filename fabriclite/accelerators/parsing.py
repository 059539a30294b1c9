"""Shared parsing of ``devices=`` values; every error names the value and what is valid."""
from __future__ import annotations

from typing import Any, List, Union

DEVICES_HELP = 'devices="auto", a positive int, -1 (all GPUs), a list of GPU indices [0, 1], or a string "0,1"'


def parse_count(devices: Any, accelerator: str) -> int:
    """``devices`` as a positive number of processes (CPU-like accelerators)."""
    if isinstance(devices, bool) or not isinstance(devices, (int, str)):
        if isinstance(devices, (list, tuple)):
            raise ValueError(
                f"devices={devices!r}: a list of device indices is for accelerator='cuda'; with "
                f"accelerator={accelerator!r} pass the number of processes, e.g. devices={len(devices) or 2}."
            )
        raise TypeError(f"devices={devices!r} ({type(devices).__name__}) is not valid; expected {DEVICES_HELP}.")
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text or text.startswith("["):
            raise ValueError(
                f"devices={devices!r}: a comma-separated list of indices is for accelerator='cuda'; with "
                f"accelerator={accelerator!r} pass the number of processes, e.g. devices=2."
            )
        try:
            devices = int(text)
        except ValueError:
            raise ValueError(f"devices={devices!r} is not a number; expected {DEVICES_HELP}.") from None
    if devices == -1:
        raise ValueError(
            f"devices=-1 means 'all GPUs' and is for accelerator='cuda'; with accelerator={accelerator!r} "
            "pass the number of processes, e.g. devices=2."
        )
    if devices <= 0:
        raise ValueError(f"devices={devices!r} must be a positive number of processes (1, 2, ...), or \"auto\".")
    return devices


def parse_indices(devices: Any, available: int, accelerator: str) -> List[int]:
    """``devices`` as a list of device indices, checked against ``available`` devices."""
    if isinstance(devices, bool) or not isinstance(devices, (int, str, list, tuple)):
        raise TypeError(f"devices={devices!r} ({type(devices).__name__}) is not valid; expected {DEVICES_HELP}.")
    indices: Union[int, List[int]]
    if isinstance(devices, str):
        text = devices.strip().strip("[]")
        try:
            if "," in text:
                indices = [int(x) for x in text.split(",") if x.strip()]
            else:
                indices = int(text)
        except ValueError:
            raise ValueError(f"devices={devices!r} is not a number or list of indices; expected {DEVICES_HELP}.") from None
    elif isinstance(devices, (list, tuple)):
        if not devices or not all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
            raise ValueError(f"devices={devices!r} must be a non-empty list of int device indices, e.g. [0, 1].")
        indices = list(devices)
    else:
        indices = devices
    if isinstance(indices, int):
        if indices == -1:
            indices = list(range(available))
        elif indices <= 0:
            raise ValueError(f"devices={devices!r} must be a positive count, -1 (all), or a list of indices.")
        else:
            if indices > available:
                raise ValueError(
                    f"devices={devices!r} asks for {indices} {accelerator} devices but {available} are available."
                )
            indices = list(range(indices))
    if len(set(indices)) != len(indices):
        raise ValueError(f"devices={devices!r} lists a device index twice.")
    bad = [i for i in indices if not 0 <= i < available]
    if bad:
        raise ValueError(
            f"devices={devices!r}: index {bad[0]} is out of range; {available} {accelerator} device(s) are "
            f"visible (indices 0..{available - 1})."
        )
    if not indices:
        raise ValueError(f"devices={devices!r} selects no {accelerator} device: none is visible.")
    return indices
