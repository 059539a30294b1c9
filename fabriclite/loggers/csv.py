"""CSVLogger: metrics to ``<root_dir>/<name>/version_<n>/metrics.csv`` (Lightning Fabric's layout and writer)."""
from __future__ import annotations

import csv
import json
import os
import warnings
from argparse import Namespace
from typing import Any, Dict, List, Optional, Union

from fabriclite.loggers.base import DummyExperiment, VersionedLogger, add_prefix, params_to_dict, rank_zero_only, to_scalar


class ExperimentWriter:
    """What ``CSVLogger.experiment`` is on global rank 0 (Lightning's ``_ExperimentWriter``): ``metrics``, the rows
    logged since the last ``save()`` (emptied by it), and ``metrics_keys``, the columns written so far.

    Creating it creates ``log_dir``; a ``log_dir`` that exists and is not empty gets a warning and its old
    ``metrics.csv`` is deleted (the new rows replace it), as Lightning's does.
    """

    NAME_METRICS_FILE = "metrics.csv"

    def __init__(self, log_dir: str) -> None:
        self.metrics: List[Dict[str, Any]] = []
        self.metrics_keys: List[str] = []
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        if os.path.isdir(log_dir) and os.listdir(log_dir):
            warnings.warn(f"Experiment logs directory {log_dir} exists and is not empty. Previous log files in this "
                          "directory will be deleted when the new ones are saved!", stacklevel=5)
            if os.path.isfile(self.metrics_file_path):
                os.remove(self.metrics_file_path)
        os.makedirs(log_dir, exist_ok=True)

    def log_metrics(self, metrics_dict: Dict[str, Any], step: Optional[int] = None) -> None:
        """Buffer one row: the metrics (tensors as numbers) and ``step`` (default: rows buffered before it)."""
        if step is None:
            step = len(self.metrics)
        row = {k: to_scalar(v) for k, v in metrics_dict.items()}
        row["step"] = step
        self.metrics.append(row)

    def save(self) -> None:
        """Append the buffered rows to ``metrics.csv`` (rewritten with the wider header when a new column
        appears) and empty the buffer."""
        if not self.metrics:
            return
        new_keys = set().union(*self.metrics) - set(self.metrics_keys)
        self.metrics_keys = sorted(set(self.metrics_keys) | new_keys)
        exists = os.path.isfile(self.metrics_file_path)
        if new_keys and exists:
            with open(self.metrics_file_path, newline="") as f:
                old = list(csv.DictReader(f))
            with open(self.metrics_file_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(old)
        with open(self.metrics_file_path, "a" if exists else "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            if not exists:
                writer.writeheader()
            writer.writerows(self.metrics)
        self.metrics = []


_ExperimentWriter = ExperimentWriter  # Lightning's name


class CSVLogger(VersionedLogger):
    """Log metrics to a CSV file, one row per ``log_metrics`` call with a ``step`` column (default: the rows
    logged since the last flush, as Lightning's).

    Rows are buffered in ``experiment.metrics`` and appended every ``flush_logs_every_n_steps`` steps and on
    ``save`` / ``finalize``; a metric name seen for the first time rewrites the file with the wider header.
    Hyperparameters go to ``hparams.json`` next to it (Lightning's raises NotImplementedError). Only global rank
    0 writes or creates directories. ``version=None`` picks the next free ``version_<n>``; a string version is
    used as the directory name. A version directory that is not empty gets a warning and a new ``metrics.csv``.
    """

    LOGGER_JOIN_CHAR = "-"
    NAME_METRICS_FILE = ExperimentWriter.NAME_METRICS_FILE
    NAME_HPARAMS_FILE = "hparams.json"

    def __init__(self, root_dir: Union[str, "os.PathLike[str]"], name: Optional[str] = "lightning_logs",
                 version: Optional[Union[int, str]] = None, prefix: str = "",
                 flush_logs_every_n_steps: int = 100) -> None:
        super().__init__(root_dir, name, version, prefix)
        if isinstance(flush_logs_every_n_steps, bool) or not isinstance(flush_logs_every_n_steps, int) \
                or flush_logs_every_n_steps < 1:
            raise ValueError(f"CSVLogger(flush_logs_every_n_steps={flush_logs_every_n_steps!r}): expected an int >= 1 "
                             "(write the buffered rows every that many steps).")
        self._flush_logs_every_n_steps = flush_logs_every_n_steps
        self._experiment: Optional[ExperimentWriter] = None

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, self.NAME_METRICS_FILE)

    @property
    def experiment(self) -> Any:
        """The ``ExperimentWriter`` (created on first use) on global rank 0; a ``DummyExperiment`` elsewhere."""
        if self.rank != 0:
            return DummyExperiment()
        if self._experiment is None:
            os.makedirs(self._root_dir, exist_ok=True)
            self._experiment = ExperimentWriter(self.log_dir)
        return self._experiment

    @rank_zero_only
    def log_hyperparams(self, params: Union[Dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        """Write ``params`` (flattened, ``a/b`` keys) to ``hparams.json`` in the log directory."""
        self.experiment  # noqa: B018 -- the log directory exists (checked for old logs) before the file is written
        with open(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), "w") as f:
            json.dump(params_to_dict(params), f, indent=2, sort_keys=True, default=str)

    @rank_zero_only
    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        metrics = add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR)
        if step is None:
            step = len(self.experiment.metrics)
        self.experiment.log_metrics(metrics, step)
        if (step + 1) % self._flush_logs_every_n_steps == 0:
            self.save()

    @rank_zero_only
    def save(self) -> None:
        self.experiment.save()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._experiment is not None:  # nothing was logged (e.g. the launching process): nothing to write
            self.save()
