"""The Logger base: what ``Fabric(loggers=[...])`` takes, and the rank-0-only rule every logger follows."""
from __future__ import annotations

import dataclasses
import functools
import os
from abc import ABC, abstractmethod
from argparse import Namespace
from collections.abc import MutableMapping
from typing import Any, Callable, Dict, List, Mapping, Optional, TypeVar, Union

from torch import Tensor

from fabriclite.environments.process_rank import rank_from_env

F = TypeVar("F", bound=Callable[..., Any])


def rank_zero_only(method: F) -> F:
    """Make a Logger method run on global rank 0 only (a no-op returning None elsewhere)."""

    @functools.wraps(method)
    def wrapper(self: "Logger", *args: Any, **kwargs: Any) -> Any:
        if self.rank != 0:
            return None
        return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def env_rank() -> int:
    """This process's rank from the environment, for a logger used without a Fabric: ``FABRICLITE_RANK`` (ranks of
    fabriclite's supervisor), else Lightning's ``rank_zero_only`` variables in Lightning's order, else 0."""
    value = os.environ.get("FABRICLITE_RANK")
    if value is not None:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"$FABRICLITE_RANK={value!r}: expected an int (the rank of this process).") from None
    return rank_from_env() or 0


class DummyExperiment:
    """What ``logger.experiment`` is on a rank other than 0 (Lightning's ``_DummyExperiment``, widened): every
    attribute, call, item and ``with`` is accepted and returns the dummy itself, so chains like
    ``logger.experiment.add_text(...)`` or ``logger.experiment[0].log(...)`` do nothing on those ranks."""

    def nop(self, *args: Any, **kwargs: Any) -> "DummyExperiment":
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # keep copy / pickle / introspection protocols intact
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> "DummyExperiment":
        return self

    def __getitem__(self, index: Any) -> "DummyExperiment":
        return self

    def __setitem__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> "DummyExperiment":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __repr__(self) -> str:
        return "DummyExperiment()"


_DummyExperiment = DummyExperiment  # Lightning's name


class Logger(ABC):
    """Base class of experiment loggers (Lightning Fabric's interface).

    Writes happen on global rank 0 only: ``Fabric`` tells each logger its rank (``bind_rank``) when the
    Fabric is created and again when the processes are launched; the ``rank_zero_only`` decorator turns
    the writing methods into no-ops on every other rank, so nothing touches the disk there. A logger used
    without a Fabric takes its rank from the environment (``env_rank``, as Lightning's ``rank_zero_only``
    does), so that only rank 0 writes there too. ``experiment`` is a ``DummyExperiment`` on other ranks.
    """

    def __init__(self) -> None:
        self._rank = env_rank()

    @property
    def rank(self) -> int:
        """The global rank of this process, as told by the Fabric that owns the logger."""
        return self._rank

    def bind_rank(self, rank: int) -> None:
        self._rank = int(rank)

    def shared_state(self) -> Dict[str, Any]:
        """What every rank must agree on with rank 0 (its resolved name / version); see ``adopt_shared_state``."""
        return {}

    def adopt_shared_state(self, state: Dict[str, Any]) -> None:
        """Take rank 0's ``shared_state()`` (called on the other ranks when the Fabric joins the job)."""

    @property
    @abstractmethod
    def name(self) -> Optional[str]:
        """The experiment name."""

    @property
    @abstractmethod
    def version(self) -> Optional[Union[int, str]]:
        """The experiment version."""

    @property
    def root_dir(self) -> Optional[str]:
        """The directory the experiments of this logger live under (None when not on disk)."""
        return None

    @property
    def log_dir(self) -> Optional[str]:
        """This experiment's directory (None when not on disk)."""
        return None

    @property
    def group_separator(self) -> str:
        return "/"

    @abstractmethod
    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        """Record ``metrics`` (name -> number) at ``step``."""

    @abstractmethod
    def log_hyperparams(self, params: Union[Dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        """Record the run's hyperparameters."""

    def log_graph(self, model: Any, input_array: Optional[Tensor] = None) -> None:
        """Record the model's graph (loggers that can)."""

    def save(self) -> None:
        """Flush what was recorded to storage."""

    def finalize(self, status: str) -> None:
        """Flush and close at the end of the run (``status``: "success", "failed", ...)."""
        self.save()


class VersionedLogger(Logger):
    """A logger writing under ``<root_dir>/<name>/version_<n>[/<sub_dir>]`` (Lightning's layout):
    ``version=None`` picks the next free ``version_<n>`` on first use; a string version is the folder name."""

    def __init__(self, root_dir: Union[str, "os.PathLike[str]"], name: Optional[str] = "lightning_logs",
                 version: Optional[Union[int, str]] = None, prefix: str = "",
                 sub_dir: Optional[Union[str, "os.PathLike[str]"]] = None) -> None:
        super().__init__()
        self._root_dir = os.fspath(root_dir)
        self._name = name or ""
        self._version = version
        self._prefix = prefix
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)

    @property
    def name(self) -> str:
        return self._name

    def shared_state(self) -> Dict[str, Any]:
        return {"name": self._name, "version": self.version, "root_dir": self._root_dir}

    def adopt_shared_state(self, state: Dict[str, Any]) -> None:
        if state.get("root_dir") == self._root_dir and state.get("name") == self._name:
            self._version = state["version"]

    @property
    def version(self) -> Union[int, str]:
        if self._version is None:
            self._version = next_version(self._versions_root())
        return self._version

    def _versions_root(self) -> str:
        """The directory holding the ``version_<n>`` directories."""
        return os.path.join(self._root_dir, self._name)

    @property
    def root_dir(self) -> str:
        return self._root_dir

    @property
    def log_dir(self) -> str:
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        path = os.path.join(self._root_dir, self._name, version)
        return os.path.join(path, self._sub_dir) if self._sub_dir else path


def share_logger_state(loggers: List[Any], rank: int, broadcast: Callable[[Any], Any]) -> None:
    """Make every rank's loggers agree with rank 0's (their versions: ``version=None`` resolves to the next
    free directory on rank 0, which the other ranks could see differently). ``broadcast(obj)`` returns rank
    0's ``obj`` on every rank; every rank must call this, whatever loggers it has (one broadcast)."""
    mine = [logger.shared_state() if isinstance(logger, Logger) else None for logger in loggers]
    states = broadcast(mine)
    if rank == 0:
        return
    for logger, state in zip(loggers, states):
        if isinstance(logger, Logger) and state:
            logger.adopt_shared_state(state)


def add_prefix(metrics: Mapping[str, Any], prefix: str, separator: str) -> Dict[str, Any]:
    """``metrics`` with ``prefix + separator`` in front of every name (unchanged for an empty prefix)."""
    if not prefix:
        return dict(metrics)
    return {f"{prefix}{separator}{k}": v for k, v in metrics.items()}


def scalars(metrics: Mapping[str, Any], convert: bool = True) -> Dict[str, Any]:
    """``metrics`` with every tensor in it (nested collections too) as a Python number (``convert=False``: only
    checked). ValueError naming the key for a tensor that has not exactly one element (Lightning: ValueError)."""
    from lightning_utilities.core.apply_func import apply_to_collection

    out: Dict[str, Any] = {}
    for key, value in metrics.items():
        def item(tensor: Tensor, key: str = key) -> Any:
            if tensor.numel() != 1:
                raise ValueError(f"The metric {key!r} is a tensor with {tensor.numel()} elements (shape "
                                 f"{tuple(tensor.shape)}), which cannot be logged as a scalar; log one number, e.g. "
                                 f"its mean, or one key per element.")
            return tensor.item() if convert else tensor

        out[key] = apply_to_collection(value, Tensor, item)
    return out


def to_scalar(value: Any) -> Any:
    """A number for a one-element tensor; other values unchanged."""
    if isinstance(value, Tensor):
        return value.item()
    return value


def params_to_dict(params: Union[Dict[str, Any], Namespace, None]) -> Dict[str, Any]:
    """Hyperparameters as a flat ``{"a/b": value}`` dict, flattened as Lightning does: a Namespace or dataclass
    becomes a dict, nested mappings and lists of mappings (``"a/0/b"``) are flattened, other values kept."""
    if isinstance(params, Namespace):
        params = vars(params)
    flat: Dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        elif isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, MutableMapping):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, list) and all(isinstance(item, MutableMapping) for item in value):  # [] goes too
            for i, item in enumerate(value):
                walk(f"{prefix}/{i}", item)
        else:
            flat[prefix] = value

    for key, value in (params or {}).items():
        walk(str(key), value)
    return flat


def sanitize_params(params: Dict[str, Any]) -> Dict[str, Any]:
    """Hyperparameter values TensorBoard can record, as Lightning makes them: numpy scalars as Python numbers;
    anything but a bool, int, float, str or tensor as its ``str()`` (classes, arrays, lists, None, ...)."""
    try:
        import numpy as np

        numbers: tuple = (np.bool_, np.integer, np.floating)
    except ImportError:  # pragma: no cover - numpy comes with the test extras, not with torch
        numbers = ()
    out = {}
    for key, value in params.items():
        if isinstance(value, numbers):
            value = value.item()
        out[key] = value if type(value) in (bool, int, float, str, Tensor) else str(value)
    return out


def next_version(root: str) -> int:
    """One more than the largest ``version_<n>`` directory under ``root`` (0 when there is none)."""
    if not os.path.isdir(root):
        return 0
    versions = [int(d[len("version_"):]) for d in os.listdir(root)
                if d.startswith("version_") and d[len("version_"):].isdigit() and os.path.isdir(os.path.join(root, d))]
    return max(versions) + 1 if versions else 0
