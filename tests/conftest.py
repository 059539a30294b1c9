"""Shared fixtures: pools of real ranks (one gloo process group each, started once per session)."""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so spawned ranks can import test modules and pool

from pool import RankPool  # noqa: E402


def _pool(world_size: int) -> Iterator[RankPool]:
    pool = RankPool(world_size)
    pool.start()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def pool2() -> Iterator[RankPool]:
    """Two ranks on one gloo process group."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def pool3() -> Iterator[RankPool]:
    """Three ranks on one gloo process group."""
    yield from _pool(3)
