"""Network faults at the store, in-process: a real TCPStore behind a loopback relay that goes silent as a partitioned
link does (tests/support/silent_proxy.py), the store client's deadlines (distributed/store_client.py), node 0's watch
over the nodes' pulses, and real Supervisors whose store stops answering. Ranks are bare interpreters (no torch)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

import pytest
from torch.distributed import HashStore

from fabriclite.distributed import job_secret, rendezvous, store_relay
from fabriclite.distributed.control_plane import failure_flag, keys, liveness, meeting
from fabriclite.distributed.store_client import RequestAbandoned, StoreClient, StoreUnreachable
from helpers import free_port
from silent_proxy import SilentProxy


@pytest.fixture()
def relayed() -> Iterator[tuple]:
    """(store server, relay in front of it)."""
    server = rendezvous.host_store("127.0.0.1", 0, timedelta(seconds=30))
    proxy = SilentProxy(("127.0.0.1", server.port)).start()
    yield server, proxy
    proxy.close()


@pytest.fixture()
def guarded() -> Iterator[tuple]:
    """(store server, the silent relay in front of node 0's authenticating relay in front of it): the way a
    supervisor of another node reaches the store with the suite's job secret (supervision/agent/job_store.py)."""
    server = rendezvous.host_store("127.0.0.1", 0, timedelta(seconds=30))
    secret = job_secret.for_job(2)
    assert secret is not None, "the suite runs with a job secret (tests/conftest.py)"
    relay = store_relay.RelayServer("127.0.0.1", 0, secret, ("127.0.0.1", server.port))
    proxy = SilentProxy(("127.0.0.1", relay.port)).start()
    yield server, proxy
    proxy.close()
    relay.close()


def _client(proxy: SilentProxy, deadline_s: float, interrupted: Callable[[], bool] = lambda: False) -> StoreClient:
    store = rendezvous.join_store("127.0.0.1", proxy.port, timedelta(seconds=30))
    return StoreClient(store, f"127.0.0.1:{proxy.port}", deadline_s, interrupted)


# ---------------------------------------------------------------------- the store client
def test_a_request_to_a_silent_store_ends_at_its_deadline_and_the_next_fails_at_once(relayed) -> None:
    server, proxy = relayed
    client = _client(proxy, deadline_s=1.0)
    assert client.add("k", 1) == 1
    proxy.set_mode("drop")
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match=rf"store at 127.0.0.1:{proxy.port} has not answered since"):
        client.add("k", 1)
    took = time.monotonic() - start
    assert 0.9 < took < 3.0, took  # the deadline, whatever TCP does (TCP alone waits ~15 minutes)
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match="earlier request is still unanswered"):
        client.get("k")
    assert time.monotonic() - start < 0.5
    assert client.unanswered_since is not None


def test_an_answer_after_a_short_flap_makes_the_store_reachable_again(relayed) -> None:
    server, proxy = relayed
    client = _client(proxy, deadline_s=5.0)
    client.set("k", "1")
    proxy.set_mode("hold")  # the link is down; what was sent arrives when it returns, as TCP retransmits it
    threading.Timer(1.0, proxy.set_mode, args=("open",)).start()
    start = time.monotonic()
    assert client.add("n", 2) == 2  # answered once the link is back, within the deadline
    assert 0.9 < time.monotonic() - start < 5.0
    assert client.unanswered_since is None and client.get("k") == b"1"


def test_a_signal_abandons_the_wait_within_a_second(relayed) -> None:
    server, proxy = relayed
    signalled = threading.Event()
    client = _client(proxy, deadline_s=60.0, interrupted=signalled.is_set)
    proxy.set_mode("drop")
    threading.Timer(0.5, signalled.set).start()
    start = time.monotonic()
    with pytest.raises(RequestAbandoned, match="interrupted"):
        client.add("k", 1)
    assert time.monotonic() - start < 0.5 + 1.0


def test_views_share_the_connection_and_its_health(relayed) -> None:
    server, proxy = relayed
    client = _client(proxy, deadline_s=1.0)
    view = client.view(meeting.job_view(client.store, 2))
    view.set("x", "1")
    assert meeting.job_view(server, 2).get("x") == b"1"
    proxy.set_mode("drop")
    with pytest.raises(StoreUnreachable):
        view.add(keys.pulse(1), 1)
    with pytest.raises(StoreUnreachable, match="still unanswered"):
        client.check(["x"])


def test_a_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="deadline_s=0"):
        StoreClient(HashStore(), "here", 0)


# ---------------------------------------------------------------------- node 0's watch and the heartbeat timeout
def test_node_0_names_the_node_whose_pulse_stopped_and_not_a_late_one() -> None:
    job = meeting.job_view(HashStore())
    watch = liveness.Heartbeats(num_nodes=4, ranks_per_node=2, timeout_s=0.3)
    liveness.announce(job, 2, "n2, 10.0.0.12")
    for node in (1, 2):
        liveness.pulse(job, node)
    assert watch.poll(job) is None  # node 3 has not pulsed yet: late, not lost
    deadline = time.monotonic() + 5
    record = None
    while record is None and time.monotonic() < deadline:
        liveness.pulse(job, 1)  # node 1 goes on, node 2 went quiet
        time.sleep(0.05)
        record = watch.poll(job)
    assert record is not None and record["lost"] == [2] and record["node"] == 2
    assert record["message"].startswith("node 2 (n2, 10.0.0.12) stopped answering at ")
    assert record["message"].endswith("its ranks: [4, 5]")
    assert failure_flag.failure_line(record).startswith("the job failed: node 2 (n2, 10.0.0.12) stopped answering")


def test_node_0_names_every_node_when_all_went_quiet() -> None:
    job = meeting.job_view(HashStore())
    watch = liveness.Heartbeats(num_nodes=3, ranks_per_node=1, timeout_s=0.2)
    for node in (1, 2):
        liveness.pulse(job, node)
    assert watch.poll(job) is None
    time.sleep(0.3)
    record = watch.poll(job)
    assert record is not None and record["lost"] == [1, 2]
    assert record["message"].startswith("nodes 1 (host unknown, ranks [1]), 2 (host unknown, ranks [2]) stopped "
                                        "answering (every other node: is node 0's own link down?)")


def test_the_heartbeat_timeout_defaults_under_the_collective_timeout(monkeypatch) -> None:
    monkeypatch.delenv(liveness.LOSS_ENV, raising=False)
    assert liveness.loss_timeout(1800) == liveness.DEFAULT_LOSS_S
    assert liveness.loss_timeout(10) == 5.0  # half the collective timeout: a lost node is named before it fires
    assert liveness.loss_timeout(1800, 4) == 4.0
    monkeypatch.setenv(liveness.LOSS_ENV, "soon")
    with pytest.raises(ValueError, match=r"heartbeat timeout 'soon' \(FABRICLITE_HEARTBEAT_TIMEOUT / "
                                         r"--heartbeat-timeout\): expected a positive number of seconds"):
        liveness.loss_timeout(1800)


# ---------------------------------------------------------------------- supervisors whose store goes silent
def _supervisor(node_rank: int, port: int, grace_s: float = 0.5) -> Any:
    from fabriclite.supervision.agent.node_layout import NodeLayout
    from fabriclite.supervision.agent.output_forwarding import OutputOptions
    from fabriclite.supervision.agent.supervisor import Supervisor

    layout = NodeLayout(num_nodes=2, node_rank=node_rank, local_world_size=1)
    return Supervisor(layout, "127.0.0.1", port, timedelta(seconds=60), OutputOptions(), grace_s=grace_s,
                      report=False)


def _run(supervisor: Any, code: str) -> int:
    from fabriclite.launchers.subprocess_script import PopenWorker

    return supervisor.run(lambda local_rank, env: PopenWorker([sys.executable, "-c", code], env, supervisor.output,
                                                              local_rank))


def _when_pulsed(server: Any, node: int, then: Callable[[], None]) -> threading.Thread:
    """Run ``then`` once node ``node``'s supervisor has pulsed twice."""
    def watch() -> None:
        job = meeting.job_view(server)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and job.add(keys.pulse(node), 0) < 2:
            time.sleep(0.05)
        then()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


SLEEPER = "import time; time.sleep(120)"


def test_a_supervisor_whose_store_never_answers_ends_on_sigint_within_a_second(guarded, monkeypatch) -> None:
    server, proxy = guarded
    monkeypatch.setenv(liveness.LOSS_ENV, "600")  # the heartbeat timeout is far: SIGINT alone ends it
    supervisor = _supervisor(1, proxy.port)
    sent = []

    def silence_then_interrupt() -> None:
        proxy.set_mode("drop")  # reads every request, never answers
        time.sleep(2 * liveness.PULSE_S)  # a pulse is in flight and unanswered
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    _when_pulsed(server, 1, silence_then_interrupt)
    code = _run(supervisor, SLEEPER)
    ended = time.monotonic()
    assert code == 128 + signal.SIGINT and sent, (code, supervisor.summary)
    assert ended - sent[0] < 1.0 + 0.5 + 0.5, ended - sent[0]  # 1 s, plus its ranks' 0.5 s grace, plus a margin
    assert supervisor.summary.startswith("fabriclite: stopped every rank on node 1 on SIGINT.")


def test_a_node_that_lost_the_store_ends_itself_naming_it(guarded, monkeypatch) -> None:
    server, proxy = guarded
    monkeypatch.setenv(liveness.LOSS_ENV, "3")
    supervisor = _supervisor(1, proxy.port)
    silenced = []
    _when_pulsed(server, 1, lambda: (proxy.set_mode("drop"), silenced.append(time.monotonic())))
    code = _run(supervisor, SLEEPER)
    took = time.monotonic() - silenced[0]
    assert code == 1, supervisor.summary
    assert 3.0 - liveness.PULSE_S < took < 3.0 + 5.0, took  # the heartbeat timeout from the last answered pulse
    first = supervisor.summary.splitlines()[0]
    assert first.startswith(f"fabriclite: node 1 lost the job's store: the job's store on node 0 "
                            f"(127.0.0.1:{proxy.port}) is unreachable since "), first
    assert "--heartbeat-timeout 3" in first
    assert not supervisor.can_restart()


def test_node_0_stops_its_ranks_naming_the_node_that_went_quiet(monkeypatch) -> None:
    monkeypatch.setenv(liveness.LOSS_ENV, "3")
    port = free_port()
    supervisor = _supervisor(0, port)
    quiet = []

    def node_1() -> None:  # node 1's supervisor as the protocol has it: it announces, pulses, then its link goes
        secret = job_secret.for_job(2)  # through its relay, as job_store opens it
        store_relay.verify_secret("127.0.0.1", port, secret, 30)
        relay = store_relay.RelayClient("127.0.0.1", port, secret)
        store = rendezvous.join_store("127.0.0.1", relay.port, timedelta(seconds=30))
        job = meeting.job_view(store)
        liveness.announce(job, 1, "n1, 10.0.0.11")
        for _ in range(3):
            liveness.pulse(job, 1)
            time.sleep(0.3)
        quiet.append(time.monotonic())

    threading.Thread(target=node_1, daemon=True).start()
    code = _run(supervisor, SLEEPER)
    assert code == 1 and quiet, supervisor.summary
    assert time.monotonic() - quiet[0] < 3.0 + 5.0
    first = supervisor.summary.splitlines()[0]
    assert first.startswith("fabriclite: the job failed: node 1 (n1, 10.0.0.11) stopped answering at "), first
    assert first.endswith("its ranks: [1]"), first


# ---------------------------------------------------------------------- gray links
def test_a_gray_link_is_slow_pulses_and_collapsed_steps_together() -> None:
    from fabriclite.supervision.agent import heartbeat

    beat = heartbeat.NodeHeartbeat(3, 1, 1, "127.0.0.1", 15.0, lambda: None)
    # as measured on the namespace hosts: ~1 ms round trips, then ~0.35 s once the link is shaped to 50 kbit/s
    beat._rtts = [0.001, 0.002, 0.001, 0.001, 0.003, 0.001]
    beat._rates = [(t * 1.5, int(t * 1.5 * 35)) for t in range(10)]  # 35 steps/s for 13.5 s
    assert not beat._slow()
    beat._rtts += [0.3, 0.45, 0.2, 0.5]
    assert not beat._slow()  # slow round trips, but the ranks still step at full speed: a busy link, not a gray one
    last = beat._rates[-1]
    beat._rates += [(last[0] + 1.5 * i, last[1] + i) for i in range(1, 5)]  # under 1 step/s from here
    best, now = heartbeat._rates(beat._rates)
    assert best == 35.0 and now is not None and now < 1.0
    assert beat._slow()
    beat._rtts[-4:] = [0.05, 0.04, 0.06, 0.05]  # under SLOW_RTT_S: a loaded machine, not a gray link
    assert not beat._slow()
    beat._rtts[-4:] = [0.3, 0.45, 0.2, 0.5]
    rates = beat._rates
    beat._rates = rates[-3:]  # slow round trips, but no earlier rate to compare with yet: wait for one
    assert not beat._slow()
    beat._rates = []  # ranks that report no steps at all: the round trips alone decide
    assert beat._slow()
    record = {"node": 1, "host": "n1", "rtt_median_s": 0.35, "rtt_max_s": 0.6, "steps_per_s": 0.5,
              "steps_per_s_before": 35.0}
    assert heartbeat._slow_line(record) == (
        "fabriclite: node 1 (n1) has a slow link to the job's store on node 0: its heartbeats take 0.35 s (median of "
        "the last 4, up to 0.6 s; a healthy link answers in milliseconds); its ranks step at 0.5 steps/s, from 35 "
        "steps/s.")


def test_a_slow_link_report_reaches_node_0_through_the_mark_on_the_pulse() -> None:
    job = meeting.job_view(HashStore())
    watch = liveness.Heartbeats(num_nodes=3, ranks_per_node=1, timeout_s=60)
    for node in (1, 2):
        liveness.pulse(job, node)
    assert watch.poll(job) is None and watch.newly_slow == []
    liveness.report_slow(job, 2, '{"node": 2}')
    assert watch.poll(job) is None and watch.newly_slow == [2]  # a slow node is not a lost one
    watch.newly_slow.clear()
    liveness.pulse(job, 2)
    assert watch.poll(job) is None and watch.newly_slow == []  # once


def test_the_slow_link_policy_is_checked(monkeypatch) -> None:
    from fabriclite.supervision.agent import heartbeat

    monkeypatch.delenv(heartbeat.SLOW_LINK_ENV, raising=False)
    assert heartbeat.slow_link_policy() == "report" and heartbeat.slow_link_policy("stop") == "stop"
    with pytest.raises(ValueError, match=r"slow-link policy 'halt' \(FABRICLITE_SLOW_LINK / --slow-link\)"):
        heartbeat.slow_link_policy("halt")


def test_a_node_that_ended_is_not_lost() -> None:
    job = meeting.job_view(HashStore())
    watch = liveness.Heartbeats(num_nodes=3, ranks_per_node=1, timeout_s=0.2)
    for node in (1, 2):
        liveness.pulse(job, node)
    assert watch.poll(job) is None
    liveness.leave(job, 2, 3, failed=False, signalled=lambda: False)  # node 2 finished first: its pulse stops
    deadline = time.monotonic() + 5
    record = None
    while record is None and time.monotonic() < deadline:
        liveness.pulse(job, 1)
        time.sleep(0.05)
        record = watch.poll(job)
        if time.monotonic() > deadline - 4:  # well past the timeout with node 2 quiet: node 1 now goes quiet too
            break
    assert record is None  # node 2 left: not lost
    time.sleep(0.3)
    record = watch.poll(job)
    assert record is not None and record["lost"] == [1]


def test_nodes_that_went_quiet_together_are_named_together() -> None:
    """Two nodes cut off at once: node 0 sees their last pulses up to a pulse interval apart, and names both."""
    job = meeting.job_view(HashStore())
    timeout = 2 * liveness.PULSE_S + 0.5
    watch = liveness.Heartbeats(num_nodes=3, ranks_per_node=1, timeout_s=timeout)
    liveness.pulse(job, 1)
    liveness.pulse(job, 2)
    assert watch.poll(job) is None
    time.sleep(liveness.PULSE_S)  # node 2's last pulse comes a pulse interval after node 1's
    liveness.pulse(job, 2)
    assert watch.poll(job) is None
    time.sleep(timeout - liveness.PULSE_S + 0.2)
    record = watch.poll(job)
    assert record is not None and record["lost"] == [1, 2], record
