"""Waits without a deadline (rank_zero_first) end as soon as the job's supervisor reports a failure."""
import time

import pytest

from fabriclite.distributed.control_plane import failure_flag
from pool import RankError

STOPPED = "test_waits/rank1-stopped-waiting"
DONE = "test_waits/rank0-block-done"


def _zero_first_while_the_job_fails(fabric):
    store = fabric.strategy.store
    try:
        with fabric.rank_zero_first():
            if fabric.global_rank == 0:
                failure_flag.publish_failure(store, {"node": 1, "rank": 3, "timestamp": time.time(),
                                                   "secondary": False, "message": "rank 3 raised ValueError: boom"})
                # rank 0 stays busy in its block until rank 1 says it stopped waiting (an event; the deadline is
                # only there so that a broken wait fails the test instead of hanging it)
                deadline = time.monotonic() + 60
                while not store.check([STOPPED]):
                    assert time.monotonic() < deadline, "rank 1 still waits for rank 0 after the job failed"
                    time.sleep(0.01)
            else:
                raise AssertionError("rank 1 ran the block before rank 0 finished")
    except failure_flag.JobFailedElsewhere:
        store.set(STOPPED, "1")  # rank 1, while rank 0 is still inside its block
        raise
    finally:
        fabric.barrier()
        if fabric.global_rank == 0:
            store.delete_key(failure_flag.FAILURE_KEY)
            store.delete_key(STOPPED)
        fabric.barrier()


def _zero_first_ok(fabric):
    store = fabric.strategy.store
    with fabric.rank_zero_first():
        if fabric.global_rank == 0:
            store.set(DONE, "1")
            seen = True
        else:
            seen = store.check([DONE])  # rank 0's block ended before this one started
    fabric.barrier()
    if fabric.global_rank == 0:
        store.delete_key(DONE)
    return seen


def test_rank_zero_first_stops_waiting_on_a_reported_failure(pool2):
    with pytest.raises(RankError) as info:
        pool2.run(_zero_first_while_the_job_fails)
    assert list(info.value.errors) == [1], info.value
    assert "JobFailedElsewhere" in info.value.errors[1] and "rank 3 raised ValueError: boom" in info.value.errors[1]
    assert pool2.run(_zero_first_ok) == [True, True]  # the flag is gone and the group still works
