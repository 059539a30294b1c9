"""Waits without a deadline (rank_zero_first) end as soon as the job's supervisor reports a failure."""
import time

import pytest

from fabriclite import rendezvous
from pool import RankError


def _zero_first_while_the_job_fails(fabric):
    store = fabric.strategy.store
    try:
        with fabric.rank_zero_first():
            if fabric.global_rank == 0:
                rendezvous.publish_failure(store, {"node": 1, "rank": 3, "timestamp": time.time(),
                                                   "secondary": False, "message": "rank 3 raised ValueError: boom"})
                time.sleep(3)  # rank 0 is still busy: rank 1 must not wait for it
            else:
                raise AssertionError("rank 1 ran the block before rank 0 finished")
    finally:
        fabric.barrier()
        if fabric.global_rank == 0:
            store.delete_key(rendezvous.FAILURE_KEY)
        fabric.barrier()


def _zero_first_ok(fabric):
    order = []
    with fabric.rank_zero_first():
        order.append(time.time())
    return order


def test_rank_zero_first_stops_waiting_on_a_reported_failure(pool2):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        pool2.run(_zero_first_while_the_job_fails)
    assert list(info.value.errors) == [1]
    assert "JobFailedElsewhere" in info.value.errors[1] and "rank 3 raised ValueError: boom" in info.value.errors[1]
    assert time.monotonic() - start < 10
    zero, one = pool2.run(_zero_first_ok)  # the flag is gone and the group still works
    assert zero[0] <= one[0]
