"""TensorBoardLogger: event files under ``<root_dir>/<name>/version_<n>`` (tensorboard is an extra:
``pip install fabriclite[tensorboard]``; it is imported on first use, on rank 0 only)."""
from __future__ import annotations

import os
import warnings
from argparse import Namespace
from typing import Any, Dict, Mapping, Optional, Union

from torch import Tensor

from fabriclite.loggers.base import (DummyExperiment, VersionedLogger, add_prefix, params_to_dict, rank_zero_only,
                                     sanitize_params, to_scalar)


class TensorBoardLogger(VersionedLogger):
    """Log to TensorBoard through ``torch.utils.tensorboard.SummaryWriter`` (Lightning Fabric's arguments).

    The writer is created on first use on global rank 0; other ranks never import tensorboard or touch the
    disk. ``log_hyperparams`` records the hparams plugin data with ``hp_metric`` (-1 until logged) when
    ``default_hp_metric``. ``~`` and ``$VARS`` in ``root_dir`` are expanded in the log directory and where
    existing versions are looked for. Extra keyword arguments go to ``SummaryWriter``. ImportError naming the
    extra when tensorboard is missing.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(self, root_dir: Union[str, "os.PathLike[str]"], name: Optional[str] = "lightning_logs",
                 version: Optional[Union[int, str]] = None, default_hp_metric: bool = True, prefix: str = "",
                 sub_dir: Optional[Union[str, "os.PathLike[str]"]] = None, **kwargs: Any) -> None:
        super().__init__(root_dir, name, version, prefix, sub_dir)
        self._default_hp_metric = default_hp_metric
        self._kwargs = kwargs
        self._experiment: Any = None

    @property
    def sub_dir(self) -> Optional[str]:
        return self._sub_dir

    @property
    def log_dir(self) -> str:
        """``<root_dir>/<name>/version_<n>[/<sub_dir>]`` with ``~`` and ``$VARS`` expanded (as Lightning's)."""
        return _expand(super().log_dir)

    def _versions_root(self) -> str:
        return _expand(super()._versions_root())

    @property
    def experiment(self) -> Any:
        """The ``SummaryWriter`` (created on first access) on global rank 0; on every other rank a
        ``DummyExperiment`` that accepts any call and does nothing (as Lightning's)."""
        if self.rank != 0:
            return DummyExperiment()
        if self._experiment is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("TensorBoardLogger needs the tensorboard package: pip install "
                                  "'fabriclite[tensorboard]' (or pip install tensorboard).") from err
            if self._root_dir:
                os.makedirs(_expand(self._root_dir), exist_ok=True)
            self._experiment = SummaryWriter(log_dir=self.log_dir, **self._kwargs)
        return self._experiment

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        for key, value in add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            value = to_scalar(value)
            if isinstance(value, dict):
                self.experiment.add_scalars(key, value, step)
                continue
            try:
                self.experiment.add_scalar(key, value, step)
            except Exception as err:  # noqa: BLE001 -- Lightning's rule: any failure to record is a ValueError
                raise ValueError(f"TensorBoardLogger.log_metrics: {key}={value!r} cannot be logged as a scalar; "
                                 "log a number, a one-element tensor or a dict of them.") from err

    @rank_zero_only
    def log_hyperparams(self, params: Union[Dict[str, Any], Namespace, None],
                        metrics: Optional[Dict[str, Any]] = None, step: Optional[int] = None) -> None:
        """Record ``params`` (flattened; values TensorBoard cannot show, such as classes, arrays, lists and tensors
        of more than one dimension, as their text, as Lightning does; a 0-dim tensor as its number) with ``metrics``
        (default ``hp_metric``: -1 when ``default_hp_metric``; nothing is recorded without metrics)."""
        from torch.utils.tensorboard.summary import hparams

        flat = sanitize_params(params_to_dict(params))
        # more than one dimension: its text (Lightning's rule); no dimension: its number (torch's hparams would fail)
        flat = {k: str(v) if getattr(v, "ndim", 0) > 1 else v.item() if isinstance(v, Tensor) and v.ndim == 0 else v
                for k, v in flat.items()}
        if metrics is None:
            metrics = {"hp_metric": -1} if self._default_hp_metric else None
        elif not isinstance(metrics, dict):
            metrics = {"hp_metric": metrics}
        if not metrics:
            return
        self.log_metrics(metrics, step)
        writer = self.experiment._get_file_writer()
        for summary in hparams(flat, metrics):
            writer.add_summary(summary, step)

    @rank_zero_only
    def log_graph(self, model: Any, input_array: Optional[Any] = None) -> None:
        """Record ``model``'s graph traced with ``input_array`` (default: ``model.example_input_array``): a tensor
        or a tuple of ``forward``'s positional arguments. Without one, or with another type, a warning says why
        and nothing is recorded (as Lightning)."""
        from fabriclite.training.wrapping import FabricModule

        input_array = getattr(model, "example_input_array", None) if input_array is None else input_array
        if isinstance(model, FabricModule):
            model = model.module
        if input_array is None:
            warnings.warn("Could not log computational graph to TensorBoard: The `model.example_input_array` "
                          "attribute is not set or `input_array` was not given.", stacklevel=3)
        elif not isinstance(input_array, (Tensor, tuple)):
            warnings.warn("Could not log computational graph to TensorBoard: The `input_array` or "
                          f"`model.example_input_array` has type {type(input_array)} which can't be traced by "
                          "TensorBoard. Make the input array a tuple representing the positional arguments to the "
                          "model's `forward()` implementation.", stacklevel=3)
        else:
            before, transfer = (getattr(model, n, None) for n in ("_on_before_batch_transfer",
                                                                   "_apply_batch_transfer_handler"))
            if callable(before) and callable(transfer):  # a LightningModule: its batch hooks, as Lightning
                input_array = transfer(before(input_array))
            self.experiment.add_graph(model, input_array)

    @rank_zero_only
    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._experiment is not None:
            self._experiment.flush()
            self._experiment.close()
            self._experiment = None

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_experiment"] = None  # a SummaryWriter does not pickle (spawned ranks make their own)
        return state


def _expand(path: str) -> str:
    return os.path.expanduser(os.path.expandvars(path))
