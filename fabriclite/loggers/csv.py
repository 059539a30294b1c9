"""CSVLogger: metrics to ``<root_dir>/<name>/version_<n>/metrics.csv`` (Lightning Fabric's layout)."""
from __future__ import annotations

import csv
import json
import os
from argparse import Namespace
from typing import Any, Dict, List, Optional, Union

from fabriclite.loggers.base import DummyExperiment, VersionedLogger, add_prefix, params_to_dict, rank_zero_only, to_scalar


class CSVLogger(VersionedLogger):
    """Log metrics to a CSV file, one row per ``log_metrics`` call with a ``step`` column (default: the
    number of rows logged before).

    Rows are buffered and appended every ``flush_logs_every_n_steps`` steps and on ``save`` / ``finalize``;
    a metric name seen for the first time rewrites the file with the wider header. Hyperparameters go to
    ``hparams.json`` next to it. Only global rank 0 writes or creates directories. ``version=None`` picks
    the next free ``version_<n>``; a string version is used as the directory name.
    """

    LOGGER_JOIN_CHAR = "-"
    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.json"

    def __init__(self, root_dir: Union[str, "os.PathLike[str]"], name: Optional[str] = "lightning_logs",
                 version: Optional[Union[int, str]] = None, prefix: str = "",
                 flush_logs_every_n_steps: int = 100) -> None:
        super().__init__(root_dir, name, version, prefix)
        self._flush_every = max(1, int(flush_logs_every_n_steps))
        self._rows: List[Dict[str, Any]] = []
        self._logged = 0  # rows logged so far: the default step
        self._keys: List[str] = []
        self._started = False

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, self.NAME_METRICS_FILE)

    @property
    def experiment(self) -> Any:
        """The logger itself (it is its own writer) on global rank 0; a ``DummyExperiment`` elsewhere."""
        return self if self.rank == 0 else DummyExperiment()

    @rank_zero_only
    def log_hyperparams(self, params: Union[Dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        self._start()
        with open(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), "w") as f:
            json.dump(params_to_dict(params), f, indent=2, sort_keys=True, default=str)

    @rank_zero_only
    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        metrics = add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR)
        row = {k: to_scalar(v) for k, v in metrics.items()}
        row["step"] = step if step is not None else self._logged
        self._rows.append(row)
        self._logged += 1
        if (row["step"] + 1) % self._flush_every == 0:
            self.save()

    @rank_zero_only
    def save(self) -> None:
        if not self._rows:
            return
        self._start()
        path = self.metrics_file_path
        new_keys = sorted({k for row in self._rows for k in row} - set(self._keys))
        exists = os.path.isfile(path)
        if new_keys:
            self._keys = sorted(self._keys + new_keys)
            if exists:
                with open(path, newline="") as f:
                    old = list(csv.DictReader(f))
                with open(path, "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=self._keys)
                    writer.writeheader()
                    writer.writerows(old)
        with open(path, "a" if exists else "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._keys)
            if not exists:
                writer.writeheader()
            writer.writerows(self._rows)
        self._rows = []

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()

    def _start(self) -> None:
        if self._started:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        if os.path.isfile(self.metrics_file_path):  # a reused version directory starts a fresh file
            os.remove(self.metrics_file_path)
        self._started = True
