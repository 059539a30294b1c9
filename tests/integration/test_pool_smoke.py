"""The rank pool itself: real ranks, real group, errors reported per rank."""
import pytest

from pool import RankError


def _facts(fabric):
    fabric.barrier()
    return (fabric.global_rank, fabric.world_size, fabric.local_rank, fabric.node_rank, fabric.is_global_zero)


def _raise_on_one(fabric):
    if fabric.global_rank == 1:
        raise KeyError("only rank 1")
    return fabric.global_rank


def test_pool_ranks(pool2):
    assert pool2.run(_facts) == [(0, 2, 0, 0, True), (1, 2, 1, 0, False)]


def test_pool_reports_rank_errors_and_stays_usable(pool2):
    with pytest.raises(RankError, match="only rank 1") as info:
        pool2.run(_raise_on_one)
    assert list(info.value.errors) == [1]
    assert pool2.run(_facts)[1][0] == 1
