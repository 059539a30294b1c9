"""The control plane's store protocol at scale, on a real TCPStore: nothing grows with the number of steps, and no
poll does O(N) work (each is counted in store requests, with N up to 1,000 simulated nodes). The simulation
behind benchmarks/control_plane.py drives the same pollers; this is its fast check."""
from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List

import pytest
from torch.distributed import TCPStore

from fabriclite.distributed.control_plane import (collective_progress, failure_flag, keys, liveness, meeting,
                                                  rank_zero_first, restart_agreement, straggler_reports)
from helpers import free_port


class Counting:
    """``store`` with every request counted (``requests``), so a test can say how many a poll makes."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return method(*args, **kwargs)
        return call

    def count(self, fn: Any, *args: Any) -> int:
        before = self.requests
        fn(*args)
        return self.requests - before


@pytest.fixture(scope="module")
def server() -> Iterator[TCPStore]:
    server = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30), multi_tenant=True)
    yield server


_round = [100]


@pytest.fixture
def view(server: TCPStore) -> Counting:
    """A fresh round's part of the store (each test its own), as supervisors and ranks see it."""
    _round[0] += 1
    return Counting(meeting.job_view(server, _round[0]))


def test_every_poll_makes_a_fixed_number_of_requests_however_many_nodes(server: TCPStore, view: Counting) -> None:
    nodes = 1000
    # the pulse: one request, and the failure flag rides in its answer
    assert view.count(liveness.pulse, view, 7) == 1
    # node 0 watching every node's pulse: two requests (check, multi_get) however many nodes
    for node in range(1, nodes):
        liveness.pulse(view.store, node)
    heartbeats = liveness.Heartbeats(nodes, 8, 15.0)
    assert view.count(heartbeats.poll, view) == 2
    # the restart agreement: node 0 reads every node's word in one request; the others one each
    _round[0] += 1
    raw = Counting(server)
    zero = restart_agreement.Agreement(raw, _round[0], 0, nodes, True, allowed=lambda: 0.0)
    other = restart_agreement.Agreement(raw, _round[0], 7, nodes, True, allowed=lambda: 0.0)
    for agreement in (zero, other):
        agreement.report()
    assert raw.count(zero.poll) == 1 and raw.count(other.poll) == 1
    # the ranks' check-in: one request per poll
    arrival = meeting.Arrival(view, keys.ARRIVED, 3, nodes * 8)
    arrival.arrive()
    assert view.count(arrival.poll) == 1
    # rank_zero_first's waiters: one request per poll while the block runs
    waiter = rank_zero_first.Waiter(view, keys.rank_zero_first(1), nodes * 8 - 1)
    assert view.count(waiter.poll) == 1
    # node 0 judging a straggler window: two requests (check, multi_get) for every node's report
    collector = straggler_reports.Collector(nodes)
    slots = {keys.straggler_report(1, n): json.dumps({"window": 1, "busy": {str(n): 0.1}}) for n in range(nodes)}
    view.store.multi_set(list(slots), list(slots.values()))
    before = view.requests
    merged = collector.collect(view, 1)
    assert view.requests - before == 2 and len(merged) == 1 and len(merged[0]) == nodes
    # the polls' ceilings keep a crowd's requests per second bounded
    assert arrival._backoff.most_s * 20000 >= nodes * 8 - 1e-9


def test_the_keys_do_not_grow_with_the_steps(view: Counting) -> None:
    """3 nodes x 2 ranks, 400 steps, a straggler window of 5 and a rank_zero_first block every 20 steps."""
    nodes, per_node, window = 3, 2, 5
    world = nodes * per_node
    collector = straggler_reports.Collector(nodes)
    counts: Dict[int, int] = {}
    for step in range(1, 401):
        if step % window == 0:
            for node in range(nodes):
                straggler_reports.publish(view, step // window, node, {node * per_node + r: 0.1 for r in
                                                                       range(per_node)})
            assert len(collector.collect(view, step // window)) == 1
        if step % 20 == 0:
            key = keys.rank_zero_first(step // 20)
            rank_zero_first.announce(view, key, "ok", world - 1)
            assert {rank_zero_first.wait(view, key, world - 1) for _ in range(world - 1)} == {"ok"}
        if step % 10 == 0:
            for rank in range(world):
                collective_progress.publish(view, rank, {"counts": {"all": [step, "all_reduce"]}, "time": 0.0,
                                                         "left": False})
            for node in range(nodes):
                assert liveness.pulse(view, node) is None
        if step in (50, 400):
            counts[step] = view.store.num_keys()
    assert counts[400] == counts[50], counts


def test_the_check_in_and_rank_zero_first_delete_what_they_are_done_with(server: TCPStore, view: Counting) -> None:
    before = server.num_keys()
    arrivals = [meeting.Arrival(view, keys.ARRIVED, rank, 4) for rank in range(4)]
    for a in arrivals:
        a.arrive()
    assert all(a.poll() for a in arrivals)
    for a in arrivals:
        a.leave()
    assert server.num_keys() == before + 1  # the count alone
    key = keys.rank_zero_first(1)
    rank_zero_first.announce(view, key, "ok", 3)
    assert [rank_zero_first.wait(view, key, 3) for _ in range(3)] == ["ok"] * 3
    assert server.num_keys() == before + 1
    rank_zero_first.announce(view, keys.rank_zero_first(2), "ok", 0)  # nobody waits: nothing written
    assert server.num_keys() == before + 1


def test_a_published_failure_reaches_every_poller_in_its_answer(view: Counting) -> None:
    arrival = meeting.Arrival(view, keys.ARRIVED, 0, 2)
    arrival.arrive()
    assert not arrival.poll()
    failure_flag.publish_failure(view, {"node": 1, "rank": 3, "message": "rank 3 raised", "secondary": False}, 2)
    for node in range(2):
        record = liveness.pulse(view, node)
        assert record is not None and record["rank"] == 3
    with pytest.raises(failure_flag.JobFailedElsewhere, match="rank 3 raised"):
        arrival.poll()
    waiter = rank_zero_first.Waiter(view, keys.rank_zero_first(9), 1)
    start = time.monotonic()
    with pytest.raises(failure_flag.JobFailedElsewhere, match="rank 3 raised"):
        while waiter.poll() is None:
            time.sleep(waiter.delay())
    assert time.monotonic() - start < 2  # the backoff's ceiling, then the failure read


def test_restart_agreement_counts_the_reports_and_cleans_the_last_round(server: TCPStore) -> None:
    _round[0] += 1
    first = _round[0]
    decisions: List[Any] = []
    for number, able in ((first, [True, True, True]), (first + 1, [True, False, True])):
        agreements = [restart_agreement.Agreement(server, number, n, 3, able[n], allowed=lambda: 0.5)
                      for n in range(3)]
        for a in agreements[1:]:
            a.report()
            assert not a.poll()
        agreements[0].report()
        assert all(a.poll() for a in agreements)
        decisions.append([a.decision for a in agreements])
    assert decisions == [[0.5] * 3, [None] * 3]
    assert not server.check([keys.restart_reports(first)]) and not server.check([keys.restart_decision(first)])
    assert restart_agreement.agree(server, first + 2, 0, 1, True, allowed=lambda: 0.0) == 0.0


def test_straggler_windows_a_node_ahead_or_behind_do_not_mix(view: Counting) -> None:
    collector = straggler_reports.Collector(2)
    straggler_reports.publish(view, 1, 0, {0: 0.1})
    assert collector.collect(view, 1) == []  # node 1 has not reported window 1 yet: tried again
    straggler_reports.publish(view, 1, 1, {1: 0.3})
    straggler_reports.publish(view, 2, 1, {1: 0.2})  # node 1 is a window ahead
    straggler_reports.publish(view, 2, 0, {0: 0.1})
    assert collector.collect(view, 2) == [{0: 0.1, 1: 0.3}, {0: 0.1, 1: 0.2}]
    straggler_reports.publish(view, 3, 0, {0: 0.1})
    straggler_reports.publish(view, 5, 1, {1: 0.1})  # node 1 two windows ahead: window 3's slot is taken
    assert collector.collect(view, 3) == []
    assert collector._pending == []


def test_progress_records_are_published_less_often_under_long_timeouts() -> None:
    assert collective_progress.publish_interval(5) == 1.0
    assert collective_progress.publish_interval(300) == 20.0
    assert collective_progress.publish_interval(1800) == 120.0
