"""What the compat programs share: the framework they run under, tiny data and models, and how results are
captured. Only ``FABRIC`` differs between the two runs of a program: ``lightning.fabric`` or ``fabriclite``
(from ``$COMPAT_FABRIC``), so each program's own imports are the one line a user would change."""
from __future__ import annotations

import importlib
import os
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

#: the package a program takes Fabric from: "lightning.fabric" (the reference) or "fabriclite"
FABRIC = os.environ.get("COMPAT_FABRIC", "lightning.fabric")


def fabric_module(sub: str = "") -> Any:
    """``lightning.fabric<sub>`` or ``fabriclite<sub>`` (``sub`` like ".loggers")."""
    return importlib.import_module(FABRIC + sub)


def make_model(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))


def make_dataset(n: int = 64, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) - x[:, 4:].sum(1, keepdim=True)).tanh()
    return torch.utils.data.TensorDataset(x, y)


def rank_batches(rank: int, count: int, seed: int = 0, size: int = 4) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of this rank's own data (different on every rank, the same in every run)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 1, generator=g)) for _ in range(count)]


def weights(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def plain(obj: Any) -> Any:
    """``obj`` with every tensor as ``(dtype name, nested list)``: what a spawned rank returns. Tensors returned
    from a spawned process travel through shared memory that the finished process no longer serves under
    Lightning's launcher, so programs return plain values (exact: a float32 becomes the same float64)."""
    if isinstance(obj, torch.Tensor):
        return (str(obj.dtype), obj.detach().cpu().tolist())
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


def recording_logger_class() -> type:
    """A Logger subclass (of the framework's ``loggers.Logger``) that keeps what it is asked to log, written
    the way Lightning's docs say custom loggers are: the writing methods under ``@rank_zero_only``."""
    loggers = fabric_module(".loggers")
    rank_zero_only = fabric_module(".utilities").rank_zero_only

    class RecordingLogger(loggers.Logger):
        def __init__(self) -> None:
            super().__init__()
            self.records: List[Any] = []

        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        @rank_zero_only
        def log_metrics(self, metrics: Dict[str, float], step: Any = None) -> None:
            self.records.append(("metrics", dict(metrics), step))

        @rank_zero_only
        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            self.records.append(("hparams", dict(params)))

    return RecordingLogger
