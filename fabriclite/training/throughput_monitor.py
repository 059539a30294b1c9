"""Throughput bookkeeping (Lightning's ``Throughput`` / ``ThroughputMonitor``) and ``measure_flops``.

``Throughput.update(time=, batches=, samples=[, lengths=, flops=])`` takes running totals; ``compute()`` gives the
totals and, once ``window_size`` updates are in, rolling rates per device and (``world_size > 1``) for the job.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Union

import torch

from fabriclite.accelerators.peak_flops import get_available_flops

Metrics = Dict[str, Union[int, float]]


class _MonotonicWindow(list):
    """The last ``maxlen`` values, each larger than the one before (a ValueError otherwise)."""

    def __init__(self, maxlen: int) -> None:
        super().__init__()
        self.maxlen = maxlen

    def append(self, x: Any) -> None:
        if len(self) > 0 and self[-1] >= x:
            raise ValueError(f"Expected the value to increase, last: {self[-1]}, current: {x}")
        list.append(self, x)
        if len(self) > self.maxlen:
            del self[0]

    def __setitem__(self, key: Any, value: Any) -> None:
        raise NotImplementedError("__setitem__ is not supported")


class Throughput:
    """Rolling throughput over the ``window_size`` most recent ``update`` calls.

    ``compute()`` returns ``time``, ``batches``, ``samples`` (and ``lengths``): the latest totals; with a full
    window, ``device/batches_per_sec``, ``device/samples_per_sec`` (``device/items_per_sec`` with lengths), and for
    ``world_size > 1`` the job-wide ``batches_per_sec``, ``samples_per_sec``, ``items_per_sec``; with ``flops``
    (per device, per update) ``device/flops_per_sec``, ``flops_per_sec`` and, given ``available_flops`` (one
    device's peak), ``device/mfu``. ``separator`` replaces "/" in those keys.
    """

    def __init__(self, available_flops: Optional[float] = None, world_size: int = 1, window_size: int = 100,
                 separator: str = "/") -> None:
        if world_size < 1 or window_size < 2:
            raise ValueError(f"Throughput(world_size={world_size}, window_size={window_size}): expected "
                             "world_size >= 1 and window_size >= 2.")
        self.available_flops = available_flops
        self.separator = separator
        self.world_size = world_size
        self._time = _MonotonicWindow(window_size)
        self._batches = _MonotonicWindow(window_size)
        self._samples = _MonotonicWindow(window_size)
        self._lengths = _MonotonicWindow(window_size)
        self._flops: Deque[int] = deque(maxlen=window_size)

    def update(self, *, time: float, batches: int, samples: int, lengths: Optional[int] = None,
               flops: Optional[int] = None) -> None:
        """Record running totals (each must increase); ``flops``: this device's FLOPs since the last update."""
        self._time.append(time)
        if samples < batches:
            raise ValueError(f"Expected samples ({samples}) to be greater or equal than batches ({batches})")
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            if lengths < samples:
                raise ValueError(f"Expected lengths ({lengths}) to be greater or equal than samples ({samples})")
            self._lengths.append(lengths)
            if len(self._samples) != len(self._lengths):
                raise RuntimeError(f"If lengths are passed ({len(self._lengths)}), there needs to be the same number "
                                   f"of samples ({len(self._samples)})")
        if flops is not None:
            self._flops.append(flops * self.world_size)

    def compute(self) -> Metrics:
        """The totals and, once the window is full, the rates (see the class docstring)."""
        sep = self.separator
        metrics: Metrics = {"time": self._time[-1], "batches": self._batches[-1], "samples": self._samples[-1]}
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        job_wide = self.world_size > 1
        if len(self._time) == self._time.maxlen:
            elapsed = self._time[-1] - self._time[0]
            batches_per_sec = (self._batches[-1] - self._batches[0]) / elapsed
            samples_per_sec = (self._samples[-1] - self._samples[0]) / elapsed
            metrics[f"device{sep}batches_per_sec"] = batches_per_sec
            metrics[f"device{sep}samples_per_sec"] = samples_per_sec
            if job_wide:
                metrics["batches_per_sec"] = batches_per_sec * self.world_size
                metrics["samples_per_sec"] = samples_per_sec * self.world_size
            if len(self._lengths) == self._lengths.maxlen:
                items_per_sec = (self._lengths[-1] - self._lengths[0]) / elapsed
                metrics[f"device{sep}items_per_sec"] = items_per_sec
                if job_wide:
                    metrics["items_per_sec"] = items_per_sec * self.world_size
        if len(self._flops) == self._flops.maxlen:
            flops_per_sec = (sum(self._flops) - self._flops[0]) / (self._time[-1] - self._time[0])
            if job_wide:
                metrics["flops_per_sec"] = flops_per_sec
            metrics[f"device{sep}flops_per_sec"] = flops_per_sec / self.world_size
            if self.available_flops:
                metrics[f"device{sep}mfu"] = flops_per_sec / self.world_size / self.available_flops
        return metrics

    def reset(self) -> None:
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


class ThroughputMonitor(Throughput):
    """``Throughput`` for a Fabric: its world size, and ``compute_and_log(step=None)`` logs the metrics through
    ``fabric.log_dict`` (the step counts calls unless given). Updates and computations happen on global rank 0;
    elsewhere they do nothing and return ``{}``. ``device/mfu`` uses the device's peak FLOP/s for the precision's
    compute dtype, looked up as Lightning does (fabriclite.accelerators.peak_flops; none on CPU);
    ``available_flops=`` (fabriclite only) gives it yourself."""

    def __init__(self, fabric: Any, **kwargs: Any) -> None:
        if "available_flops" not in kwargs:
            kwargs["available_flops"] = get_available_flops(
                fabric.device, compute_dtype(fabric.strategy.precision)) if fabric.is_global_zero else None
        super().__init__(world_size=fabric.world_size, **kwargs)
        self._fabric = fabric
        self.step = -1

    def update(self, *, time: float, batches: int, samples: int, lengths: Optional[int] = None,
               flops: Optional[int] = None) -> None:
        if self._fabric.is_global_zero:
            super().update(time=time, batches=batches, samples=samples, lengths=lengths, flops=flops)

    def compute(self) -> Metrics:
        return super().compute() if self._fabric.is_global_zero else {}

    def compute_and_log(self, step: Optional[int] = None, **kwargs: Any) -> Metrics:
        """Compute and log through the Fabric's loggers at ``step`` (default: one more than the last)."""
        if not self._fabric.is_global_zero:
            return {}
        self.step = (self.step + 1) if step is None else step
        metrics = self.compute(**kwargs)
        self._fabric.log_dict(metrics=metrics, step=self.step)
        return metrics

    def reset(self) -> None:
        if self._fabric.is_global_zero:
            super().reset()


def compute_dtype(precision: Any) -> torch.dtype:
    """The dtype a precision plugin computes in (what its peak FLOP/s are looked up for): its input dtype (mixed and
    true modes), else float32."""
    return getattr(precision, "input_dtype", None) or torch.float32


def measure_flops(model: torch.nn.Module, forward_fn: Callable[[], torch.Tensor],
                  loss_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> int:
    """FLOPs of ``forward_fn()`` (which runs ``model``), plus ``loss_fn(output).backward()`` when ``loss_fn`` is
    given. A model and inputs on the meta device cost no memory or compute: ``with torch.device("meta"): ...``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        if loss_fn is None:
            forward_fn()
        else:
            loss_fn(forward_fn()).backward()
    return counter.get_total_flops()


__all__: List[str] = ["Throughput", "ThroughputMonitor", "get_available_flops", "measure_flops"]
