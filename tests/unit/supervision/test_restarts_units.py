"""The restart loop's decisions, in process (no ranks): backoff, the window, used-up restarts, a signal during
the backoff; parsing of the settings; the round a rank reads."""
from __future__ import annotations

import pytest

from fabriclite.supervision.agent import restarts
from fabriclite.supervision.agent.restarts import RestartPolicy, run_rounds


class Node:
    """One node's supervisor as run_rounds sees it: plays rounds from a script of exit codes."""

    def __init__(self, codes, policy):
        self.codes, self.restarts, self.summary = list(codes), policy, ""
        self.layout = type("Layout", (), {"num_nodes": 1, "node_rank": 0})()
        self.played, self.stopped = [], False

    def play(self, number):
        self.played.append(number)
        code = self.codes.pop(0)
        self.summary = "" if code == 0 else f"fabriclite: the job failed: rank 1 exited with code {code}."
        return code

    def can_restart(self):
        return not self.stopped

    def stopped_code(self, code):
        return 75 if self.stopped else code


def test_the_first_restart_is_immediate_then_the_backoff_doubles_up_to_30_s():
    policy = RestartPolicy(10)
    assert [policy.backoff(n) for n in range(8)] == [0, 1, 2, 4, 8, 16, 30, 30]
    policy = RestartPolicy(10, backoff_s=0.5, first_backoff_s=3)  # $FABRICLITE_RESTART_BACKOFF=0.5, ..._FIRST_...=3
    assert [policy.backoff(n) for n in range(4)] == [3, 0.5, 1, 2]


def test_backoff_settings_from_the_environment(monkeypatch):
    assert (RestartPolicy.from_env(2).backoff_s, RestartPolicy.from_env(2).first_backoff_s) == (1.0, 0.0)
    monkeypatch.setenv(restarts.BACKOFF_ENV, "0.25")
    monkeypatch.setenv(restarts.FIRST_BACKOFF_ENV, "2")
    assert [RestartPolicy.from_env(3).backoff(n) for n in range(3)] == [2, 0.25, 0.5]
    monkeypatch.setenv(restarts.FIRST_BACKOFF_ENV, "soon")
    with pytest.raises(ValueError, match=r"\$FABRICLITE_FIRST_RESTART_BACKOFF='soon': expected a number of seconds"):
        RestartPolicy.from_env(3)


def test_restarts_until_success_and_the_final_summary_lists_every_round(monkeypatch):
    slept = []
    monkeypatch.setattr(restarts.time, "sleep", slept.append)
    node = Node([3, 3, 0], RestartPolicy(5))
    reported = []
    assert run_rounds(node, node.play, reported.append) == 0
    assert node.played == [0, 1, 2] and slept == [0, 1]  # the first restart immediate, the second after 1 s
    assert "restarting every rank now (round 1, restart 1 of 5)" in reported[0]
    assert "restarting every rank in 1 s (round 2, restart 2 of 5)" in reported[1]
    assert "round 0: failed: rank 1 exited with code 3" in node.summary and "round 2: succeeded" in node.summary


def test_used_up_restarts_and_an_over_window_end_with_the_last_failure(monkeypatch):
    monkeypatch.setattr(restarts.time, "sleep", lambda s: None)
    node = Node([3, 4], RestartPolicy(1))
    assert run_rounds(node, node.play, lambda text: None) == 4
    assert node.summary.endswith("not restarting: the 1 restarts (--max-restarts) are used up; the job failed, last "
                                 "failure: rank 1 exited with code 4.")
    node = Node([3, 3], RestartPolicy(5, window_s=0.5))  # the second backoff (1 s) would end past the window
    assert run_rounds(node, node.play, lambda text: None) == 3
    assert node.played == [0, 1]  # the first restart, immediate, fits it
    assert "restart window of 0.5 s (--restart-window) is over" in node.summary


def test_a_preemption_during_the_backoff_starts_no_new_round(monkeypatch):
    node = Node([3, 0], RestartPolicy(3))
    monkeypatch.setattr(restarts.time, "sleep", lambda s: setattr(node, "stopped", True))  # the signal arrives
    assert run_rounds(node, node.play, lambda text: None) == 75
    assert node.played == [0] and "preempted during the backoff" in node.summary


def test_settings_are_parsed_with_clear_errors(monkeypatch):
    assert restarts.parse_max_restarts("2") == 2
    for bad in (-1, "x", 1.5, True):
        with pytest.raises(ValueError, match="expected a whole number >= 0"):
            restarts.parse_max_restarts(bad, "--max-restarts")
    monkeypatch.setenv("FABRICLITE_MAX_RESTARTS", "2")
    assert restarts.resolve_max_restarts(None) == 2 and restarts.resolve_max_restarts(2) == 2
    with pytest.raises(ValueError, match="differs from FABRICLITE_MAX_RESTARTS=2"):
        restarts.resolve_max_restarts(1)


def test_the_restart_count_adds_fabriclites_rounds_slurms_requeues_and_torchruns_restarts(monkeypatch):
    for name in restarts.RESTART_COUNTERS:
        monkeypatch.delenv(name, raising=False)
    assert restarts.restart_count() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    assert restarts.restart_count() == 4
    monkeypatch.setenv("FABRICLITE_RESTART_COUNT", "2")
    assert restarts.restart_count() == 6
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued once, then a fabriclite round in the new allocation
    assert restarts.restart_count() == 3
    monkeypatch.setenv("SLURM_RESTART_COUNT", "one")
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT='one' is not a whole number"):
        restarts.restart_count()


def test_the_restart_count_is_agreed_only_under_torchrun(monkeypatch):
    class Alone:
        world_size = 1

    class Three:
        world_size = 3

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert not restarts.needs_agreement()
    assert restarts.agree_restart_count(Alone()) == 2
    assert restarts.agree_restart_count(Three()) == 2  # every rank of a SLURM job reads the same count
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert restarts.needs_agreement()  # each agent counts its own: the ranks take the maximum (a collective)
