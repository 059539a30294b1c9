"""Peak FLOP/s of common accelerators per dtype, for model FLOPs utilisation (``ThroughputMonitor``'s
``device/mfu``): Lightning Fabric 2.6's table and chip-name rules (its ``utilities.throughput``), so both report the
same MFU. CPUs and unknown chips have no entry (None). Vendor datasheet values, dense (no sparsity)."""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Union

import torch

_COLUMNS = (torch.float64, torch.float32, "tfloat32", torch.bfloat16, torch.float16, torch.int8, "int4")

#: chip -> FLOP/s for (float64, float32, tfloat32, bfloat16, float16, int8, int4); None: not supported / not known
_CUDA_ROWS = {
    # Hopper: nvdam.widen.net/s/nb5zzzsjdf (H200), resources.nvidia.com/en-us-tensor-core (H100)
    "h200 sxm1": (3.4e13, 6.7e13, 9.9e14, 2.0e15, 2.0e15, 4.0e15, None),
    "h200 nvl1": (3.0e13, 6.0e13, 8.4e14, 1.7e15, 1.7e15, 3.3e15, None),
    "h100 nvl": (67e12, 133.8e12, 989.4e12, 1978.8e12, 1978.8e12, 3957.8e12, None),
    "h100 sxm": (33.5e12, 66.9e12, 494.7e12, 989.4e12, 989.4e12, 1978.9e12, None),
    "h100 pcie": (25.6e12, 51.2e12, 378e12, 756e12, 756e12, 1513e12, None),
    # Ada: NVIDIA Ada GPU architecture whitepaper v2.1
    "rtx 4090": (None, 82.6e12, 82.6e12, 82.6e12, 82.6e12, 660.6e12, 1321.2e12),
    "rtx 4080": (None, 48.7e12, 48.7e12, 48.7e12, 48.7e12, 389.9e12, 779.8e12),
    "rtx 4080 super": (None, 52.2e12, 52.2e12, 52.2e12, 52.2e12, 417.6e12, 835.2e12),
    "l4": (None, 30.3e12, 60e12, 121e12, 121e12, 242e12, 484e12),
    "l40": (None, 90.5e12, 90.5e12, 181e12, 181e12, 362e12, 724e12),
    # Ampere: A100 datasheet (SXM and PCIe alike), A10 datasheet, GA102 whitepaper
    "a100": (9.7e12, 19.5e12, 156e12, 312e12, 312e12, 624e12, None),
    "a6000": (None, 38.7e12, 77.4e12, 38.7e12, 38.7e12, 309.7e12, 619.3e12),
    "a40": (None, 37.4e12, 74.8e12, 37.4e12, 37.4e12, 299.3e12, 598.7e12),
    "a10g": (None, 31.2e12, 62.5e12, 125e12, 125e12, 250e12, 500e12),
    "rtx 3090 ti": (None, 40e12, 40e12, 40e12, 40e12, 320e12, 640e12),
    "rtx 3090": (None, 35.6e12, 35.6e12, 35.6e12, 35.6e12, 284e12, 568e12),
    "rtx 3080 ti": (None, 34.1e12, 34.1e12, 34.1e12, 34.1e12, 272.8e12, 546.6e12),
    "rtx 3080": (None, 29.8e12, 29.8e12, 29.8e12, 29.8e12, 238e12, 476e12),
    "rtx 3070": (None, 20.3e12, 20.3e12, 20.3e12, 20.3e12, 162.6e12, 325.2e12),
    # Turing: T4 datasheet, Quadro RTX 5000 datasheet
    "t4": (None, 8.1e12, None, None, 65e12, 130e12, 260e12),
    "quadro rtx 5000": (None, 11.2e12, None, None, 89.2e12, None, None),
    "rtx 2080 super": (None, 11.2e12, None, None, 22.3e12, 178.4e12, 356.8e12),
    "rtx 2080 ti": (None, 14.2e12, None, None, 28.5e12, 227.7e12, 455.4e12),
    "rtx 2080": (None, 10.6e12, None, None, 21.2e12, 169.6e12, 339.1e12),
    "rtx 2070 super": (None, 9.1e12, None, None, 18.1e12, 145e12, 290e12),
    "titan rtx": (None, 16.3e12, None, None, 32.6e12, 261e12, 522e12),
    # Volta: V100 datasheet
    "v100 sxm": (7.8e12, 15.7e12, None, None, 125e12, None, None),
    "v100 pcie": (7e12, 14e12, None, None, 112e12, None, None),
    "v100s pcie": (8.2e12, 16.4e12, None, None, 130e12, None, None),
}
CUDA_FLOPS: Dict[str, Dict[Union[str, torch.dtype], float]] = {
    chip: {dtype: value for dtype, value in zip(_COLUMNS, row) if value is not None}
    for chip, row in _CUDA_ROWS.items()
}
#: TPU generation -> FLOP/s (bfloat16 matmuls whatever the dtype): arXiv 1907.10701, cloud.google.com/tpu/docs
TPU_FLOPS: Dict[str, float] = {"v2": 45e12, "v3": 123e12, "v4": 275e12, "v5litepod": 197e12}


def cuda_chip(device_name: str) -> Optional[str]:
    """The ``CUDA_FLOPS`` key for ``torch.cuda.get_device_name()`` (Lightning's rules), or None when not recognised."""
    chip = device_name.lower()
    if "h200" in chip:
        return "h200 sxm1" if "sxm1" in chip else "h200 nvl1" if "nvl1" in chip else chip
    if "h100" in chip:
        return ("h100 sxm" if "hbm3" in chip else "h100 nvl" if "nvl" in chip
                else "h100 pcie" if "pcie" in chip or "hbm2e" in chip else chip)
    if "l4" in chip:
        return "l40" if "tesla" in chip else "l4"
    if "geforce rtx" in chip:
        number = chip.split(" ")[3]
        return f"rtx {number}" + (" super" if "super" in chip else " ti" if "ti" in chip else "")
    for key, pattern in (("a6000", "a6000"), ("a100", "a100"), ("a40", "a40"), ("a10g", "a10g"), ("t4", "t4"),
                         ("quadro rtx 5000", "quadro rtx 5000"), ("titan rtx", "titan rtx"),
                         ("v100 sxm", "v100-sxm"), ("v100 pcie", "v100-pcie"), ("v100s pcie", "v100s-pcie")):
        if pattern in chip:
            return key
    return None


def get_available_flops(device: torch.device, dtype: Union[torch.dtype, str]) -> Optional[int]:
    """One ``device``'s peak FLOP/s for ``dtype`` (float32 counts as tfloat32 on Ampere or later unless
    ``torch.get_float32_matmul_precision()`` is "highest"); None, with a warning naming the chip, where the table
    has no value, and None without one for CPUs and other devices (as Lightning)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        chip = cuda_chip(name)
        if chip is None:
            warnings.warn(f"FLOPs not found for {name!r}", stacklevel=2)
            return None
        if chip not in CUDA_FLOPS:
            warnings.warn(f"FLOPs not found for {name!r}, chip is {chip!r}", stacklevel=2)
            return None
        if dtype is torch.float32 and torch.cuda.get_device_capability(device)[0] >= 8 \
                and torch.get_float32_matmul_precision() != "highest":
            dtype = "tfloat32"
        if dtype not in CUDA_FLOPS[chip]:
            warnings.warn(f"{name!r} does not support {dtype}", stacklevel=2)
            return None
        return int(CUDA_FLOPS[chip][dtype])
    if device.type == "xla":
        from torch_xla._internal import tpu

        tpu_env = tpu.get_tpu_env()
        name = tpu_env.get("TYPE") or tpu_env["ACCELERATOR_TYPE"].split("-")[0]
        if name.lower() not in TPU_FLOPS:
            warnings.warn(f"FLOPs not found for TPU {name!r} with {dtype}", stacklevel=2)
            return None
        return int(TPU_FLOPS[name.lower()])
    return None
