"""The control plane without processes: its functions driven over torch's in-process HashStore, several "nodes" as
threads, the way a simulation of many nodes would drive them (fabriclite/distributed/control_plane/)."""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List

import pytest
from torch.distributed import HashStore

from fabriclite.distributed.control_plane import (collective_progress, failure_flag, keys, liveness, meeting,
                                                  restart_agreement, straggler_reports)


def on_nodes(count: int, play: Callable[[int], Any]) -> Dict[int, Any]:
    """``play(node)`` on ``count`` threads at once; node -> what it returned."""
    got: Dict[int, Any] = {}
    threads = [threading.Thread(target=lambda n=n: got.__setitem__(n, play(n))) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return got


def test_the_restart_agreement_is_node_0s_decision_on_every_node():
    store = HashStore()
    got = on_nodes(3, lambda n: restart_agreement.agree(store, 0, n, 3, True, lambda: 2.5))
    assert got == {0: 2.5, 1: 2.5, 2: 2.5}
    got = on_nodes(3, lambda n: restart_agreement.agree(store, 1, n, 3, n != 2, lambda: 2.5))  # node 2 cannot go on
    assert got == {0: None, 1: None, 2: None}
    assert store.get(keys.restart_decision(1)) == b'{"delay": null}'


def test_the_failure_flag_keeps_the_root_cause_and_ends_waits():
    job = meeting.job_view(HashStore(), 3)  # round 3's part
    assert failure_flag.read_failure(job) is None and not failure_flag.failed(job)
    failure_flag.publish_failure(job, {"node": 1, "rank": 3, "message": "lost a peer", "secondary": True})
    failure_flag.publish_failure(job, {"node": 0, "rank": 1, "message": "rank 1 raised", "secondary": False})
    failure_flag.publish_failure(job, {"node": 2, "rank": 5, "message": "later", "secondary": False})
    assert failure_flag.describe_failure(failure_flag.read_failure(job)) == "node 0: rank 1 raised"
    with pytest.raises(failure_flag.JobFailedElsewhere, match="stopped waiting for rank 0: the job failed on node 0"):
        failure_flag.wait_for_key(job, "never", "waiting for rank 0")


def test_every_rank_checks_in_and_node_0_leaves_once_the_others_ended():
    store = HashStore()
    job = meeting.job_view(store)
    on_nodes(4, lambda r: meeting.wait_for_ranks(job, keys.ARRIVED, r, 4, timedelta(seconds=20)))
    assert job.add(f"{keys.ARRIVED}/count", 0) == 4
    assert meeting.missing_ranks(job, keys.ARRIVED, 4) == [0, 1, 2, 3]  # each deleted its own key once all arrived
    assert all(liveness.pulse(job, n) is None for n in range(3))
    left: List[int] = []
    on_nodes(3, lambda n: (liveness.leave(job, n, 3, False, lambda: False), left.append(n)))
    assert sorted(left) == [0, 1, 2] and job.add(keys.ENDED, 0) == 3
    assert [job.add(keys.pulse(n), 0) for n in range(3)] == [1, 1 + keys.LEFT, 1 + keys.LEFT]  # 1, 2 marked left


def test_straggler_reports_and_collective_progress_round_trip():
    job = meeting.job_view(HashStore(), 1)
    collector = straggler_reports.Collector(2)
    assert straggler_reports.publish(job, 7, 0, {0: 0.01, 1: 0.02})
    assert collector.collect(job, 7) == []  # node 1 has not reported window 7 yet
    straggler_reports.publish(job, 7, 1, {2: 0.03})
    assert collector.collect(job, 8) == [{0: 0.01, 1: 0.02, 2: 0.03}]
    assert collective_progress.read(job, 2) is None
    collective_progress.publish(job, 2, {"counts": {"0,1,2": [4, "all_reduce"]}, "time": 1.0, "left": False})
    assert collective_progress.read(job, 2)["counts"] == {"0,1,2": [4, "all_reduce"]}


def test_every_key_has_one_name():
    names = [keys.FAILURE, keys.ARRIVED, keys.PULSE, keys.ENDED, keys.restart_reports(0),
             keys.restart_decision(0), keys.straggler_report(2, 1), keys.straggler_report(3, 1),
             keys.collective_progress(1), keys.rank_zero_first(3), keys.rank_zero_first(3, 1),
             keys.readers(keys.rank_zero_first(3))]
    assert len(set(names)) == len(names)
    assert keys.round_part(0) == "" and keys.round_part(2) == "round2"

