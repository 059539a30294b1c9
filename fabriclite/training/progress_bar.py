"""A progress bar that draws on global rank 0 only (tqdm, imported on first use: ``pip install
fabriclite[progress]``)."""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

from fabriclite.supervision.rank import progress as rank_progress


class NullBar:
    """What the other ranks get: iterates like the wrapped iterable; every bar method is a no-op."""

    def __init__(self, iterable: Optional[Iterable[Any]] = None, **kwargs: Any) -> None:
        self.iterable = iterable
        self.total = kwargs.get("total")
        self.n = 0

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("This progress bar has no iterable; use update() instead.")
        return iter(self.iterable)

    def __len__(self) -> int:
        return len(self.iterable) if self.iterable is not None else int(self.total or 0)  # type: ignore[arg-type]

    def __enter__(self) -> "NullBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def update(self, n: float = 1) -> None:
        self.n += n  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:  # set_postfix, set_description, write, close, refresh, ...
        if name.startswith("__"):
            raise AttributeError(name)
        return _nop


def _nop(*args: Any, **kwargs: Any) -> None:
    return None


def progress_bar(iterable: Optional[Iterable[Any]] = None, *, enabled: bool = True, **kwargs: Any) -> Any:
    """A ``tqdm`` bar over ``iterable`` (keyword arguments go to tqdm) when ``enabled``, else a ``NullBar``
    that iterates the same items silently. ImportError naming the extra when tqdm is missing."""
    if not enabled:
        return NullBar(iterable, **kwargs)
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        raise ImportError("The progress bar needs tqdm: pip install 'fabriclite[progress]' (or pip install tqdm).") \
            from err
    record = rank_progress.progress()
    if record is None:
        return tqdm(iterable, **kwargs)
    return _bar_class(tqdm)(iterable, _record=record, **kwargs)


_bars: dict = {}


def _bar_class(tqdm: Any) -> Any:
    """tqdm showing the slowest rank (``slowest=rank 2 +35%``) while the supervisor names a straggler
    (fabriclite.supervision.watch.stragglers); one look at a shared-memory field per item."""
    if tqdm not in _bars:
        class StragglerBar(tqdm):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, _record: Any = None, **kwargs: Any) -> None:
                self._record, self._shown = _record, None
                super().__init__(*args, **kwargs)

            def _show_slowest(self) -> None:
                slowest = self._record.slowest() if self._record is not None else None
                if slowest != self._shown:
                    self._shown = slowest
                    self.set_postfix(slowest=f"rank {slowest[0]} +{100 * slowest[1]:.0f}%" if slowest else "-")

            def __iter__(self) -> Iterator[Any]:
                for item in super().__iter__():
                    self._show_slowest()
                    yield item

            def update(self, n: float = 1) -> Any:
                self._show_slowest()
                return super().update(n)

        _bars[tqdm] = StragglerBar
    return _bars[tqdm]
