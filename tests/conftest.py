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


def _suite_job_secret() -> None:
    """The suite's multi-node jobs run closed, as a user's must (issue 42): one job secret for the session, in a
    private folder outside the checkout, inherited by every process the tests start (a test of a job without one
    removes $FABRICLITE_JOB_SECRET_FILE from its own environment)."""
    import atexit
    import shutil
    import tempfile

    from fabriclite.distributed import job_secret

    if os.environ.get(job_secret.SECRET_FILE_ENV):
        return
    folder = tempfile.mkdtemp(prefix="fabriclite-test-secret-")
    path = os.path.join(folder, "job.secret")
    job_secret.write_new_secret(path)
    os.environ[job_secret.SECRET_FILE_ENV] = path
    atexit.register(shutil.rmtree, folder, True)


_suite_job_secret()


# The guard for the next slow test (issue 45): a unit test (tests/unit/) that is not marked `slow` must end within
# UNIT_TIMEOUT_S, set-up and teardown included (pytest-timeout's per-test marker, added here; the rest of the suite
# keeps pyproject's 300 s default and its own markers). A unit test that takes long on purpose (fresh interpreters,
# sleeps) is marked `slow` and keeps the 300 s default; a unit test with its own timeout above the limit must be `slow`.
# Measured 2026-12-02 (tests/unit, 606 tests): alone at load 0.6 the slowest test not marked slow took 6.2 s (a rank
# that sleeps 6 s); with 2 busy loops on the 2 cores at load 6-19 (8 min 46 s in all), 14.4 s
# (test_hostlist_roundtrip): 60 s is 4x that. The 8 tests marked slow for it each start a fresh interpreter that
# imports torch: 1.8-4.7 s alone, 33-61 s at that load.
UNIT_TIMEOUT_S = 60
_UNIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit") + os.sep
_OVER_LIMIT = pytest.StashKey[str]()
_GUARDED = pytest.StashKey[bool]()


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if not str(item.path).startswith(_UNIT_DIR) or item.get_closest_marker("slow") is not None:
            continue
        own = item.get_closest_marker("timeout")
        if own is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))
            item.stash[_GUARDED] = True
            continue
        seconds = own.args[0] if own.args else own.kwargs.get("timeout")
        if seconds is None or not 0 < float(seconds) <= UNIT_TIMEOUT_S:  # 0 / None: no timeout at all
            item.stash[_OVER_LIMIT] = (f"{item.nodeid} has timeout {seconds!r} s, over the {UNIT_TIMEOUT_S} s limit of "
                                       "a unit test: mark it @pytest.mark.slow (tests/conftest.py, UNIT_TIMEOUT_S)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _OVER_LIMIT in item.stash:
        pytest.fail(item.stash[_OVER_LIMIT], pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.stash.get(_GUARDED, False) and "from pytest-timeout" in str(report.longrepr):
        report.sections.append(("unit test limit", f"a unit test not marked slow must end within {UNIT_TIMEOUT_S} s "
                                "(tests/conftest.py, UNIT_TIMEOUT_S): make it faster, or mark it @pytest.mark.slow "
                                "if it takes long on purpose"))


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
