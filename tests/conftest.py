"""Shared fixtures: pools of real ranks (one gloo process group each, started once per session)."""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

# the harness (tests/support) is importable by name here and in spawned ranks (pool, helpers, ...)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

from helpers import CLUSTER_VARS  # noqa: E402
from pool import RankPool  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Jobs started by the tests keep their run folders (the events record when no log dir is given:
    ``$XDG_STATE_HOME/fabriclite/runs/``) in the session's temporary folder, not the user's ``~/.local/state``."""
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = before


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


@pytest.fixture(scope="module")
def pool4() -> Iterator[RankPool]:
    """Four ranks on one gloo process group, for one test module (its ranks may keep that module's state)."""
    yield from _pool(4)


@pytest.fixture
def no_launch_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This test's environment without scheduler / launcher variables (helpers.CLUSTER_VARS) or Lightning's CLI
    variables (LT_*): a Fabric made here sees a plain process. Returns ``monkeypatch``, to set some back."""
    for name in list(os.environ):
        if CLUSTER_VARS.match(name) or name.startswith("LT_"):
            monkeypatch.delenv(name)
    return monkeypatch
