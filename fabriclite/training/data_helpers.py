"""Small data helpers: ``AttributeDict`` (a dict with attribute access, for a checkpoint's state) and
``suggested_max_num_workers``."""
from __future__ import annotations

from typing import Any


class AttributeDict(dict):
    """A dict whose keys read and write as attributes: ``state = AttributeDict(model=model, step=0)``,
    ``state.step += 1``. Pass it to ``fabric.save`` / ``fabric.load`` like a dict."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{key}'") from e

    def __setattr__(self, key: str, val: Any) -> None:
        self[key] = val

    def __delattr__(self, item: str) -> None:
        if item not in self:
            raise KeyError(item)
        del self[item]

    def __repr__(self) -> str:
        if not len(self):
            return ""
        width = max(len(str(k)) for k in self) + 3
        return "\n".join(("{:" + str(width) + "s} {}").format(f'"{k}":', self[k]) for k in sorted(self.keys()))


def suggested_max_num_workers(local_world_size: int) -> int:
    """An upper bound for a DataLoader's ``num_workers`` on each of ``local_world_size`` ranks on this machine:
    the cores this process may use, shared by the ranks, less one for the rank itself (at least 1).
    ValueError for ``local_world_size < 1``."""
    from fabriclite.accelerators.cpu import available_cores

    if local_world_size < 1:
        raise ValueError(f"suggested_max_num_workers(local_world_size={local_world_size}): expected >= 1 (the "
                         "number of ranks on this machine).")
    return max(1, available_cores() // local_world_size - 1)
