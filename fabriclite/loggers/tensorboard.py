"""TensorBoardLogger: event files under ``<root_dir>/<name>/version_<n>`` (tensorboard is an extra:
``pip install fabriclite[tensorboard]``; it is imported on first use, on rank 0 only)."""
from __future__ import annotations

import os
from argparse import Namespace
from typing import Any, Dict, Mapping, Optional, Union

from torch import Tensor

from fabriclite.loggers.base import DummyExperiment, VersionedLogger, add_prefix, params_to_dict, rank_zero_only, to_scalar


class TensorBoardLogger(VersionedLogger):
    """Log to TensorBoard through ``torch.utils.tensorboard.SummaryWriter`` (Lightning Fabric's arguments).

    The writer is created on first use on global rank 0; other ranks never import tensorboard or touch the
    disk. ``log_hyperparams`` records the hparams plugin data with ``hp_metric`` (-1 until logged) when
    ``default_hp_metric``. Extra keyword arguments go to ``SummaryWriter``. ImportError naming the extra
    when tensorboard is missing.
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
            os.makedirs(self._root_dir, exist_ok=True)
            self._experiment = SummaryWriter(log_dir=self.log_dir, **self._kwargs)
        return self._experiment

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        for key, value in add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            if isinstance(value, Mapping):
                self.experiment.add_scalars(key, {k: to_scalar(v) for k, v in value.items()}, step)
            else:
                self.experiment.add_scalar(key, to_scalar(value), step)

    @rank_zero_only
    def log_hyperparams(self, params: Union[Dict[str, Any], Namespace], metrics: Optional[Dict[str, Any]] = None,
                        step: Optional[int] = None) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {k: v if isinstance(v, (int, float, str, bool, Tensor)) else str(v)
                for k, v in params_to_dict(params).items()}
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
    def log_graph(self, model: Any, input_array: Optional[Tensor] = None) -> None:
        from fabriclite.training.wrapping import FabricModule

        if isinstance(model, FabricModule):
            model = model.module
        input_array = getattr(model, "example_input_array", None) if input_array is None else input_array
        if input_array is None:
            raise ValueError("log_graph(model): pass input_array (or set model.example_input_array).")
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
