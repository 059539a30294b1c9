"""XLA devices (``accelerator="tpu"``) through torch_xla's PJRT runtime.

torch_xla is imported only when this accelerator is created or asked about a TPU. Nothing here initialises the
XLA runtime (that must happen in the launched processes, after ``xmp.spawn``).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, List, Union

import torch

from fabriclite.accelerators.base import Accelerator

INSTALL_RECIPE = ("`pip install torch==2.9.1 torch-xla==2.9.0` (torch_xla pins its torch), or `make env-xla` for "
                  "the cached lane environment; see docs/backends.md")


def import_xla() -> Any:
    """``torch_xla.core.xla_model``; ModuleNotFoundError with the install recipe when torch_xla is missing."""
    try:
        import torch_xla.core.xla_model as xm
    except ImportError as err:
        raise ModuleNotFoundError(f"accelerator='tpu' needs torch_xla, which cannot be imported ({err}). "
                                  f"Install it with {INSTALL_RECIPE}.") from None
    return xm


def pjrt_device() -> str:
    """The PJRT device type this process will use: ``PJRT_DEVICE`` (upper-cased, e.g. "TPU", "CPU"), else "TPU"
    when TPU chips are attached, else ""."""
    configured = os.environ.get("PJRT_DEVICE", "").strip().upper().split("_")[0]
    if configured:
        return configured
    return "TPU" if _tpu_devices() > 0 else ""


def _tpu_devices() -> int:
    if importlib.util.find_spec("torch_xla") is None:
        return 0
    saved = os.environ.get("PJRT_DEVICE")
    try:
        from torch_xla._internal import tpu

        return int(tpu.num_available_devices())
    except Exception:  # noqa: BLE001 - probing hardware must never break "auto"
        return 0
    finally:  # importing torch_xla sets PJRT_DEVICE=CPU when it finds no TPU: a probe must not choose for the user
        if saved is None:
            os.environ.pop("PJRT_DEVICE", None)
        else:
            os.environ["PJRT_DEVICE"] = saved


class XLAAccelerator(Accelerator):
    """TPU cores (or, with ``PJRT_DEVICE=CPU``, XLA's CPU devices: ``CPU_NUM_DEVICES``, default 1).

    ``devices``: 1, all local devices (an int or "auto"), or ``[i]`` for one given device, as in Lightning.
    ``is_available()`` is True only for a real TPU, so ``accelerator="auto"`` never picks XLA on a CPU host;
    XLA on the CPU must be asked for: ``accelerator="tpu"`` with ``PJRT_DEVICE=CPU``.
    """

    name = "tpu"

    def __init__(self) -> None:
        kind = pjrt_device()  # before importing torch_xla, which defaults PJRT_DEVICE to CPU on a CPU host
        import_xla()
        if not kind:
            raise ValueError("accelerator='tpu' found no TPU on this machine and PJRT_DEVICE is not set. On a TPU VM "
                             "check that the chips are visible; to run XLA on the CPU (for testing) set "
                             "PJRT_DEVICE=CPU (and CPU_NUM_DEVICES=N for N devices).")

    @staticmethod
    def is_available() -> bool:
        return _tpu_devices() > 0 and os.environ.get("PJRT_DEVICE", "TPU").strip().upper().startswith("TPU")

    @staticmethod
    def auto_device_count() -> int:
        kind = pjrt_device()
        if kind == "TPU":
            return max(1, _tpu_devices())
        return max(1, int(os.environ.get(f"{kind}_NUM_DEVICES", "1") or 1))

    @staticmethod
    def parse_devices(devices: Any) -> Union[int, List[int]]:
        count = XLAAccelerator.auto_device_count()
        valid = f"1, {count} (all), 'auto' or [i] with 0 <= i < {count}"
        parsed: Any = devices
        if isinstance(devices, str):
            text = devices.strip()
            try:
                parsed = [int(x) for x in text.strip("[]").split(",") if x.strip()] if "[" in text or "," in text \
                    else int(text)
            except ValueError:
                raise ValueError(f"devices={devices!r} is not valid for accelerator='tpu'; expected {valid}.") from None
        if isinstance(parsed, bool) or not isinstance(parsed, (int, list, tuple)):
            raise TypeError(f"devices={devices!r} ({type(devices).__name__}) is not valid for accelerator='tpu'; "
                            f"expected {valid}.")
        if isinstance(parsed, int) and parsed in (1, count):
            return parsed
        if isinstance(parsed, (list, tuple)) and len(parsed) == 1 and isinstance(parsed[0], int) \
                and 0 <= parsed[0] < count:
            return [parsed[0]]
        raise ValueError(f"devices={devices!r} is not valid for accelerator='tpu' with {count} XLA device(s) "
                         f"({pjrt_device() or 'no'} PJRT device); expected {valid}.")

    @staticmethod
    def get_parallel_devices(devices: Any) -> List[torch.device]:
        if isinstance(devices, (list, tuple)):
            return [torch.device("xla", int(devices[0]))]
        return [torch.device("xla", i) for i in range(int(devices))]

    def setup_device(self, device: torch.device, local_world_size: int = 1) -> None:
        """Nothing to claim: the XLA runtime assigns each launched process (or thread) its device."""
