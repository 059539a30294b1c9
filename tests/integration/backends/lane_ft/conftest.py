"""The ft lane's tests: each test's own bounds on its jobs (``RUN_TIMEOUT_S``: 300-480 s a job, then the job is
killed and the test fails naming it) are the verdict. pytest-timeout only catches a test that hangs outside them, so
it sits above them: LANE_TIMEOUT_S for every test without its own marker (pyproject's 300 s default cut the
streaming-DiLoCo test, whose job may take 480 s, at load 30-40 in a CI run, and left its nodes running into the next
test). Whatever a test started is ended after it, however it ended."""
import os
from typing import Iterator

import pytest

from ft_harness import stop_left

# the longest test: two jobs in a row (the partitioned group's run, then its return), each bounded at 300 s, plus
# the partition's own waits (23 s + 60 s): 683 s at most before its own bounds fail it
LANE_TIMEOUT_S = 900
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if str(item.path).startswith(_HERE) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LANE_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _no_job_left() -> Iterator[None]:
    yield
    stop_left()
