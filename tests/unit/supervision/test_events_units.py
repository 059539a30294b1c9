"""The events record and goodput's arithmetic, in-process: appending, the switch, the run id, and each badput part
measured from its own events across two launches of one run (a requeue)."""
from __future__ import annotations

import json
import os
import time

import pytest

from fabriclite.supervision.watch import events, goodput


def test_events_append_one_json_line_each_with_schema_and_run(tmp_path, monkeypatch):
    path = str(tmp_path / "logs" / "events-node1.jsonl")
    log = events.EventLog(path, "run7", 1)
    log.emit("job_start", launch=0)
    events.EventLog(path, "run7", 1).emit("job_end", exit_code=0)  # a second writer appends
    lines = [json.loads(line) for line in open(path)]
    assert [(e["schema"], e["run"], e["node"], e["event"]) for e in lines] == [
        ("fabriclite.events/2", "run7", 1, "job_start"), ("fabriclite.events/2", "run7", 1, "job_end")]
    assert events.read(path, "other") == []
    monkeypatch.setenv("FABRICLITE_LOG_DIR", str(tmp_path / "d"))
    assert events.events_path(3, "run7") == str(tmp_path / "d" / "events-node3.jsonl")
    assert events.events_path(3, "run7", str(tmp_path / "e")) == str(tmp_path / "e" / "events-node3.jsonl")
    monkeypatch.delenv("FABRICLITE_LOG_DIR")
    # no log dir: the run's folder under $XDG_STATE_HOME, never the working directory
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    runs = tmp_path / "state" / "fabriclite" / "runs"
    assert events.events_path(0, "run7") == str(runs / "run7" / "events-node0.jsonl")
    monkeypatch.setenv("XDG_STATE_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert events.run_folder("run7") == str(tmp_path / "home" / ".local" / "state" / "fabriclite" / "runs" / "run7")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)  # a state folder that cannot be written: a temporary one
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "ro"))
    monkeypatch.setattr(events.tempfile, "tempdir", str(tmp_path / "tmp"))
    if os.access(tmp_path / "ro", os.W_OK):  # root writes anywhere: the state folder is then fine
        assert events.run_folder("run7") == str(tmp_path / "ro" / "fabriclite" / "runs" / "run7")
    else:
        assert events.run_folder("run7").startswith(str(tmp_path / "tmp" / "fabriclite-"))
    monkeypatch.setenv("FABRICLITE_EVENTS", "0")
    assert events.for_supervisor(0, "r", None) is None and goodput.JobRecord(0, "r", None, 2).rank_env() == {}


def _e(t, event, **fields):
    return {"schema": events.SCHEMA, "run": "r", "node": 0, "time": t, "event": event, **fields}


def test_goodput_parts_across_a_restart_and_a_requeue():
    records = [
        # launch 0: round 0 fails 3 s after its checkpoint; round 1 is preempted
        _e(0, "job_start"), _e(1, "round_start", round=0), _e(5, "ranks_up", round=0, first_step=4),
        _e(10, "checkpoint", round=0, blocked=2.0, step=5), _e(13, "failure", round=0),
        _e(13.5, "round_end", round=0, exit_code=137, steps=9, last_step=13),
        _e(16, "restart", round=1, backoff=2), _e(16, "round_start", round=1),
        _e(18, "ranks_up", round=1, first_step=18), _e(25, "preemption_notice", signal=10),
        _e(27, "round_end", round=1, exit_code=0, steps=8, last_step=26), _e(28, "job_end", exit_code=75),
        # launch 1 (a requeue, appended): one clean round
        _e(100, "job_start"), _e(101, "round_start", round=0), _e(103, "ranks_up", round=0, first_step=103),
        _e(110, "round_end", round=0, exit_code=0, steps=8, last_step=109), _e(111, "job_end", exit_code=0),
    ]
    g = goodput.measure(records)
    assert g.wall == pytest.approx(28 + 11)
    assert g.badput["startup"] == pytest.approx((1 + 3) + 2 + (1 + 2))  # to round_start, then to the first step
    assert g.badput["restart"] == pytest.approx(3)  # failure (13) to the next round_start (16)
    assert g.badput["redone"] == pytest.approx(3) and g.redone_steps == 4  # checkpoint (10) to last step (13)
    assert g.badput["checkpoint"] == pytest.approx(2)
    assert g.badput["preemption"] == pytest.approx(2)  # notice (25) to its round's end (27)
    # steps that counted: round 0 (4..13, less 2 s stall, less 3 s redone), round 1 (18..26), launch 1 (103..109)
    assert g.good == pytest.approx((9 - 2 - 3) + 8 + 6)
    assert g.other == pytest.approx(39 - 18 - (9 + 3 + 3 + 2 + 2))
    line = g.line("f.jsonl")
    assert line.startswith("fabriclite: goodput 46.2% (18.0 s of 39.0 s in steps that counted); badput: start-up "
                           "9.0 s, restart 3.0 s, redone steps 3.0 s (4 steps), checkpoint stalls 2.0 s, preemption "
                           "2.0 s, other 2.0 s (events: f.jsonl)"), line


def test_a_straggler_is_named_once_after_enough_windows_in_a_row(monkeypatch):
    from fabriclite.supervision.watch.stragglers import StragglerWatch

    monkeypatch.setenv("FABRICLITE_STRAGGLER_WINDOW", "4")
    monkeypatch.setenv("FABRICLITE_STRAGGLER_WINDOWS", "2")
    watch = StragglerWatch(0, 1, lambda rank: rank // 2)
    assert watch.threshold == 0.25
    slow = {0: 0.010, 1: 0.011, 2: 0.010, 3: 0.020}  # rank 3: +90% over the median 0.0105
    assert watch.judge(slow) == []  # one window is not enough
    named = watch.judge(slow)
    assert [(s.rank, s.node, round(s.slower, 2), s.windows) for s in named] == [(3, 1, 0.9, 2)]
    assert named[0].line.startswith("fabriclite: straggler: rank 3 (node 1) is 90% slower than the median rank")
    assert watch.judge(slow) == [] and watch.slowest[0] == 3  # named once
    assert watch.judge({0: 0.010, 1: 0.011, 2: 0.010, 3: 0.011}) == [] and watch.slowest is None  # caught up
    # the records' way in: busy time per step since the previous window's end
    records = {r: {"steps": 4, "busy_ns": int(4 * b * 1e9)} for r, b in slow.items()}
    watch.reset()
    assert watch.stragglers(records) == [] and watch.stragglers(records) == []  # window 1 once, then nothing new
    monkeypatch.setenv("FABRICLITE_STRAGGLER_THRESHOLD", "-1")
    with pytest.raises(ValueError, match=r"\$FABRICLITE_STRAGGLER_THRESHOLD='-1' is not valid: expected a fraction"):
        StragglerWatch(0, 1, lambda rank: 0)


def test_step_rates_give_each_ranks_steps_per_second_once_per_interval(monkeypatch):
    from fabriclite.supervision.watch.step_rates import StepRates
    from fabriclite.supervision.watch.watcher import RoundView

    def view(steps0, steps1, first):
        return RoundView({0: {"steps": steps0, "first_step_time": first},
                          4: {"steps": steps1, "first_step_time": first}}, {})

    watcher = StepRates(every_s=0.05)
    watcher.start_round(2)
    assert watcher.observe(view(0, 0, None)) == []  # within the interval
    time.sleep(0.06)
    assert watcher.observe(view(0, 0, None)) == []  # no rank stepped: nothing to draw
    first = time.time()
    time.sleep(0.1)
    (event,) = watcher.observe(view(6, 3, first))
    assert event.kind == "steps" and event.fields["round"] == 2 and event.fields["steps"] == {"0": 6, "4": 3}
    # the first interval is measured from the first step, not from the round's start
    assert 0.1 <= event.fields["seconds"] < 0.5, event.fields
    rates = event.fields["per_second"]
    assert rates["0"] == pytest.approx(6 / event.fields["seconds"], rel=0.01) and rates["0"] == pytest.approx(
        2 * rates["4"], rel=0.01)
    time.sleep(0.06)
    (event,) = watcher.observe(view(8, 4, first))  # later intervals count only their own steps
    assert event.fields["per_second"]["0"] == pytest.approx(2 / event.fields["seconds"], rel=0.01)
    monkeypatch.setenv("FABRICLITE_STEPS_EVERY", "0")
    assert StepRates().every_s == 0
    monkeypatch.setenv("FABRICLITE_STEPS_EVERY", "soon")
    with pytest.raises(ValueError, match=r"\$FABRICLITE_STEPS_EVERY='soon' is not valid: expected seconds"):
        StepRates()
def test_the_goodput_line_is_printed_when_something_cost_time_or_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("FABRICLITE_LOG_DIR", str(tmp_path))
    runs = iter(range(100))

    def job_end(kinds, mode, wall=3.0):
        record = goodput.JobRecord(0, f"run{next(runs)}", None, 2)
        started = time.time()
        record.log.emit("job_start")
        for kind in kinds:
            record.log.emit(kind, round=0)
        with monkeypatch.context() as patch:  # the job ends ``wall`` seconds after it started
            patch.setattr(time, "time", lambda: started + wall)
            return record.job_end(0, requeued=False, mode=mode)

    assert job_end([], "auto") is None  # a short clean run: nothing to say
    for kind in goodput.COSTLY_EVENTS:
        assert job_end([kind], "auto").startswith("fabriclite: goodput"), kind
    assert job_end(["failure"], "never") is None
    assert job_end([], "always").startswith("fabriclite: goodput")
    assert job_end([], "auto", wall=goodput.LONG_RUN_S + 60).startswith("fabriclite: goodput")  # a long run
    monkeypatch.setenv("FABRICLITE_GOODPUT", "ALWAYS")
    assert goodput.goodput_from_env() == "always"
    monkeypatch.setenv("FABRICLITE_GOODPUT", "sometimes")
    with pytest.raises(ValueError, match=r"\$FABRICLITE_GOODPUT='sometimes': expected one of auto, always, never"):
        goodput.goodput_from_env()
