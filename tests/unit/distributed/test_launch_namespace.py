"""meeting.launch_namespace: the ranks of one torchrun round meet in a part of a store that outlives rounds (the
agents' shared TCPStore), never in an earlier round's, whatever order they arrive in. Real TCPStores (one server,
one client per rank, ranks as threads); the torchrun lane runs it under real agents."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Dict, List, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import TCPStore

from fabriclite.distributed import rendezvous
from fabriclite.distributed.control_plane import meeting
from helpers import free_port

TIMEOUT = timedelta(seconds=30)


@pytest.fixture(scope="module")
def server() -> TCPStore:
    return TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def _round(server: TCPStore, world: int, delays: Sequence[float]) -> Dict[int, str]:
    """One start of ``world`` ranks, rank r arriving after ``delays[r]`` seconds; rank -> the prefix it got."""
    got: Dict[int, str] = {}
    errors: List[BaseException] = []

    def rank(r: int) -> None:
        try:
            time.sleep(delays[r])
            client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
            got[r] = meeting.launch_namespace(client, r, world, TIMEOUT)
        except BaseException as err:  # noqa: BLE001  reported below
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return got


@settings(max_examples=8, deadline=None)
@given(rounds=st.lists(st.tuples(st.integers(2, 3), st.lists(st.sampled_from([0.0, 0.05, 0.2]), min_size=3,
                                                                              max_size=3)),
                       min_size=2, max_size=3))
def test_every_round_meets_in_one_fresh_part(server: TCPStore, rounds) -> None:
    seen: List[str] = []
    for world, delays in rounds:  # rank 0 often arrives last: the others first read the earlier round's prefix
        got = _round(server, world, delays)
        assert sorted(got) == list(range(world))
        assert len(set(got.values())) == 1, got
        prefix = got[0]
        assert prefix not in seen, f"round {len(seen)} reused an earlier round's prefix {prefix}"
        seen.append(prefix)


def test_a_rank_0_that_never_comes_is_a_clear_error(server: TCPStore) -> None:
    _round(server, 2, [0.0, 0.0])  # an earlier round left its prefix under "current"
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
    with pytest.raises(rendezvous.RendezvousError, match=r"rank 0 of this start never named its part of torchrun"):
        meeting.launch_namespace(client, 1, 2, timedelta(seconds=1))
