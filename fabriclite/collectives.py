"""Collection-aware collectives over a strategy's primitives (issue 4 fills this module)."""
from __future__ import annotations

from typing import Any, Optional

from fabriclite.strategies.base import Strategy


def barrier(strategy: Strategy, name: Optional[str] = None, group: Any = None) -> None:
    """Wait until every rank of ``group`` (default: all) reaches this point."""
    strategy.barrier(name, strategy.resolve_group(group))
