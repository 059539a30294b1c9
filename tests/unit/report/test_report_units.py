"""fabriclite report in-process: reading records of schema 1 and 2 (job_history.py), the page's marks and its
offline promise (html_page.py), the Perfetto trace's fields and its merge into a real torch profiler trace
(perfetto_trace.py), and the CLI's error rule. The real jobs, rendered in Chromium, are in
tests/integration/report/test_job_report.py."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from fabriclite import cli
from fabriclite.report import html_page, job_history, perfetto_trace
from fabriclite.supervision.watch import goodput


def _e(schema: int, t: float, event: str, node: int = 0, run: str = "r1", **fields: Any) -> Dict[str, Any]:
    return {"schema": f"fabriclite.events/{schema}", "run": run, "time": t, "node": node, "event": event, **fields}


def v1_crash_and_restart(t0: float = 1_700_000_000.0) -> List[Dict[str, Any]]:
    """docs/reliability.md's example: rank 1 killed 6 steps after a checkpoint, restarted once."""
    return [_e(1, t0 + t, name, **f) for t, name, f in [
        (0.0, "job_start", {"launch": 0, "ranks": 2, "pid": 26166}), (0.1, "round_start", {"round": 0}),
        (25.6, "restore", {"source": None, "seconds": 0.001, "round": 0}),
        (26.0, "ranks_up", {"round": 0, "first_step": t0 + 25.7, "seconds": 25.6}),
        (28.4, "checkpoint", {"path": "/run/ckpt/step-8.ckpt", "bytes": 2213, "seconds": 1.56, "blocked": 1.56,
                              "step": 8, "round": 0}),
        (29.6, "failure", {"round": 0, "rank": 1, "cause": "rank 1 (local rank 1, node 0) was killed by SIGKILL",
                           "exit_code": 137, "hang": False}),
        (30.0, "round_end", {"round": 0, "exit_code": 137, "steps": 14, "first_step": t0 + 25.7,
                             "last_step": t0 + 29.2}),
        (32.0, "restart", {"round": 1, "backoff": 2.0}), (32.0, "round_start", {"round": 1}),
        (51.8, "restore", {"source": "/run/ckpt/step-8.ckpt", "seconds": 0.04, "round": 1}),
        (52.0, "ranks_up", {"round": 1, "first_step": t0 + 51.9, "seconds": 19.9}),
        (60.0, "round_end", {"round": 1, "exit_code": 0, "steps": 16, "first_step": t0 + 51.9,
                             "last_step": t0 + 54.2}),
        (60.0, "job_end", {"exit_code": 0})]]


def v2_two_nodes_preempted_and_requeued(t0: float = 1_700_000_000.0) -> List[Dict[str, Any]]:
    """Schema 2: two nodes of 2 ranks; steps events; a checkpoint; a straggler and a hang on node 1; a preemption
    and a SLURM requeue, then a second launch that finishes."""
    command = ["python", "train.py", "--lr", "0.1"]
    start = {"ranks": 2, "command": command, "slurm_job_id": "4242", "torchrun_restart_count": None}
    out = []
    for node in (0, 1):
        out += [_e(2, t0 + t, name, node=node, **f) for t, name, f in [
            (0.0, "job_start", {**start, "launch": 0, "slurm_restart_count": 0, "pid": 10 + node,
                                "host": f"n{node}"}),
            (0.5, "round_start", {"round": 0}), (5.0, "ranks_up", {"round": 0, "first_step": t0 + 4.5}),
            (15.0, "steps", {"round": 0, "seconds": 10.0, "steps": {str(2 * node): 40, str(2 * node + 1): 40},
                             "per_second": {str(2 * node): 4.0, str(2 * node + 1): 3.5}}),
            (20.0, "preemption_notice", {"signal": 10}),
            (22.0, "round_end", {"round": 0, "exit_code": 0, "steps": 60, "first_step": t0 + 4.5,
                                 "last_step": t0 + 21.0}),
            (22.1, "requeue", {"exit_code": 0}), (22.2, "job_end", {"exit_code": 75}),
            (100.0, "job_start", {**start, "launch": 1, "slurm_restart_count": 1, "pid": 20 + node,
                                  "host": f"n{node}"}),
            (100.5, "round_start", {"round": 0}), (104.0, "ranks_up", {"round": 0, "first_step": t0 + 103.5}),
            (110.0, "round_end", {"round": 0, "exit_code": 0, "steps": 30, "first_step": t0 + 103.5,
                                  "last_step": t0 + 109.0}),
            (110.5, "job_end", {"exit_code": 0})]]
    out.append(_e(2, t0 + 12.0, "checkpoint", node=0, round=0, path="/c/step-30.ckpt", bytes=100, seconds=1.0,
                  blocked=1.0, step=30))  # global rank 0's, in node 0's file only
    out.append(_e(2, t0 + 18.0, "straggler", node=1, rank=3, slower=0.4, windows=3))
    out.append(_e(2, t0 + 19.0, "hang", node=1, round=0, reason="rank 2 stuck <in> all_reduce",
                  stacks="rank 2:\n  File \"train.py\", line 9, in <module>\n    fabric.all_reduce(x)"))
    return out


def write_lines(path: Path, records: List[Dict[str, Any]], extra: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + extra)
    return path


def test_schema_1_gives_rounds_marks_rates_and_the_same_goodput_as_the_printed_line(tmp_path):
    records = v1_crash_and_restart()
    write_lines(tmp_path / "run" / "events-node0.jsonl", records, "not json\n{\"schema\": \"other/1\"}\n")
    history = job_history.load([str(tmp_path / "run")])
    assert history.run == "r1" and history.schemas == ["fabriclite.events/1"] and history.ranks == {0: [0, 1]}
    assert [(r.number, r.outcome, r.steps) for r in history.rounds] == [(0, "failed", 14), (1, "ok", 16)]
    assert [m.kind for m in history.marks] == ["restore", "checkpoint", "failure", "restart", "restore"]
    failure = next(m for m in history.marks if m.kind == "failure")
    assert failure.rank == 1 and "SIGKILL" in failure.detail
    checkpoint = next(m for m in history.marks if m.kind == "checkpoint")
    assert checkpoint.duration == 1.56 and checkpoint.time == pytest.approx(records[4]["time"] - 1.56)
    # schema 1 has no steps events: each round's average, (steps - 1) / (last step - first step)
    assert [round(r.per_second, 3) for r in history.rates] == [round(13 / 3.5, 3), round(15 / 2.3, 3)]
    assert history.command is None and history.engine == {"launch": 0, "launches": 1}
    assert history.goodput[0] == goodput.measure(records)


def test_schema_2_gives_each_ranks_rate_the_command_and_the_engine(tmp_path):
    records = v2_two_nodes_preempted_and_requeued()
    for node in (0, 1):
        write_lines(tmp_path / f"events-node{node}.jsonl", [r for r in records if r["node"] == node])
    history = job_history.load([str(tmp_path / "events-node0.jsonl"), str(tmp_path / "events-node1.jsonl")])
    assert history.nodes == [0, 1] and history.ranks == {0: [0, 1], 1: [2, 3]}
    assert history.command == ["python", "train.py", "--lr", "0.1"]
    assert history.engine["slurm_job_id"] == "4242" and history.engine["slurm_restart_count"] == 1
    assert history.engine["launches"] == 2 and history.engine["host"] == "n0" and "launch" not in history.engine
    ranked = sorted((r.rank, r.per_second) for r in history.rates if r.rank is not None)
    assert ranked == [(0, 4.0), (1, 3.5), (2, 4.0), (3, 3.5)]
    assert {k: history.count(k) for k in job_history.MARK_KINDS} == {
        "failure": 0, "restart": 0, "preemption": 2, "requeue": 2, "checkpoint": 1, "restore": 0, "hang": 1,
        "straggler": 1}
    assert [r.outcome for r in history.rounds] == ["preempted", "preempted", "ok", "ok"]
    straggler = next(m for m in history.marks if m.kind == "straggler")
    assert (straggler.node, straggler.rank) == (1, 3)
    assert history.goodput[0].badput["preemption"] == pytest.approx(2.0)
    # rank 0's checkpoint held every node's loop: node 1's goodput counts it too
    assert history.goodput[1].badput["checkpoint"] == history.goodput[0].badput["checkpoint"] == 1.0


def test_the_latest_run_by_default_another_by_run_and_clear_errors(tmp_path):
    old = [dict(r, run="old") for r in v1_crash_and_restart(1_600_000_000.0)]
    path = write_lines(tmp_path / "events-node0.jsonl", old + v1_crash_and_restart())
    assert job_history.load([str(path)]).run == "r1"
    history = job_history.load([str(path)], run="old")
    assert history.run == "old" and history.other_runs == {"r1": 13}
    with pytest.raises(ValueError, match=r"run 'nope' is not in .*it holds the runs old, r1"):
        job_history.load([str(path)], run="nope")
    with pytest.raises(ValueError, match="does not exist"):
        job_history.load([str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no events files"):
        job_history.load([str(tmp_path / "empty")])
    newer = write_lines(tmp_path / "newer.jsonl", [_e(9, 1.0, "job_start")])
    with pytest.raises(ValueError, match=r"found fabriclite.events/9: written by a newer fabriclite"):
        job_history.load([str(newer)])


def test_a_launch_without_job_end_is_counted_to_its_last_event_not_to_now(tmp_path):
    records = v1_crash_and_restart()[:7]  # the supervisor was SIGKILLed after round 0 ended
    history = job_history.build(records, "r1")
    assert len(history.unfinished) == 1 and history.rounds[0].outcome == "failed"
    assert history.goodput[0].wall == pytest.approx(records[-1]["time"] - records[0]["time"])


def marks_in(page: str) -> Dict[str, int]:
    found = re.findall(r'data-mark="(\w+)"', page)
    return {k: found.count(k) for k in job_history.MARK_KINDS}


@pytest.mark.parametrize("records", [v1_crash_and_restart(), v2_two_nodes_preempted_and_requeued()],
                         ids=["schema1", "schema2"])
def test_the_page_has_one_mark_per_event_and_fetches_nothing(records):
    history = job_history.build(records, "r1")
    page = html_page.render(history)
    counted = {k: sum(1 for r in records if r["event"] == {"preemption": "preemption_notice"}.get(k, k))
               for k in job_history.MARK_KINDS}
    assert marks_in(page) == counted
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    # nothing to fetch: no src attribute, no link but the empty data: icon, no url() in the style
    assert not re.search(r"\ssrc=", page) and re.findall(r"href=\"([^\"]*)\"", page) == ["data:,"]
    assert "url(" not in page and "@import" not in page


def test_the_page_names_the_run_the_command_and_the_engine():
    page = html_page.render(job_history.build(v2_two_nodes_preempted_and_requeued(), "r1"))
    assert "python train.py --lr 0.1" in page and "SLURM job 4242, restart count 1; node 0 on n0" in page
    assert "Hangs and their stacks" in page and "fabric.all_reduce(x)" in page
    assert "<in>" not in page and "&lt;in&gt;" in page  # the record's text is escaped


@pytest.mark.parametrize("records", [v1_crash_and_restart(), v2_two_nodes_preempted_and_requeued()],
                         ids=["schema1", "schema2"])
def test_every_trace_event_has_the_required_fields_and_rounds_nest_in_launches(records):
    history = job_history.build(records, "r1")
    document = json.loads(json.dumps(perfetto_trace.trace(history)))
    events = document["traceEvents"]
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= set(e), e
        assert e["ph"] in ("X", "i", "C", "M"), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
    complete = [e for e in events if e["ph"] == "X"]
    for r in (e for e in complete if e["cat"] == "round"):
        assert any(l["pid"] == r["pid"] and l["ts"] <= r["ts"] and r["ts"] + r["dur"] <= l["ts"] + l["dur"] + 1
                   for l in complete if l["cat"] == "launch"), r
    kinds = [e["name"] for e in events if e["ph"] in ("i", "X") and e.get("cat") in job_history.MARK_KINDS]
    assert sorted(kinds) == sorted(m.kind for m in history.marks)
    assert document["otherData"]["run"] == "r1"


def test_the_cli_writes_the_page_or_the_trace_and_bad_input_is_one_error_line(tmp_path, capsys):
    path = write_lines(tmp_path / "events-node0.jsonl", v1_crash_and_restart())
    assert cli.main(["report", str(tmp_path), "--output", str(tmp_path / "out" / "r.html")]) == 0
    assert marks_in((tmp_path / "out" / "r.html").read_text())["failure"] == 1
    assert cli.main(["report", str(path), "--format", "perfetto", "-o", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        cli.main(["report", str(tmp_path / "missing")])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fabriclite report: error: '{tmp_path / 'missing'}' does not exist; pass a run folder or "
                   "events-node<N>.jsonl files."]


def test_beside_merges_the_job_into_a_real_torch_profiler_trace_on_its_time_base(tmp_path, capsys):
    import torch
    from torch.profiler import profile

    records = v1_crash_and_restart(t0=time.time() - 60)  # a job whose last event (t0 + 60 s) is about now
    write_lines(tmp_path / "events-node0.jsonl", records)
    with profile() as prof:
        torch.ones(64).sum()
    prof.export_chrome_trace(str(tmp_path / "prof.json"))
    profiler = json.loads((tmp_path / "prof.json").read_text())
    assert cli.main(["report", str(tmp_path / "events-node0.jsonl"), "--format", "perfetto", "--beside",
                     str(tmp_path / "prof.json"), "-o", str(tmp_path / "both.json")]) == 0
    both = json.loads((tmp_path / "both.json").read_text())
    theirs = len(profiler["traceEvents"])
    assert both["traceEvents"][:theirs] == profiler["traceEvents"] and both["otherData"]["fabriclite"]["run"] == "r1"
    launch = next(e for e in both["traceEvents"][theirs:] if e["name"] == "launch 0")
    assert launch["ts"] == pytest.approx(records[0]["time"] * 1e6 - profiler["baseTimeNanoseconds"] / 1000, abs=1)
    # on the profiler's time base, the profiled op (run just now) comes right after the job's end
    op = max(e["ts"] for e in profiler["traceEvents"] if e.get("ph") == "X")
    assert 0 < op - (launch["ts"] + launch["dur"]) < 120e6, (op, launch)
    capsys.readouterr()
    for flags in (["--beside", str(tmp_path / "prof.json")],  # html has nothing to merge into
                  ["--format", "perfetto", "--beside", str(tmp_path / "events-node0.jsonl")]):  # not a trace
        with pytest.raises(SystemExit) as ended:
            cli.main(["report", str(tmp_path / "events-node0.jsonl"), *flags])
        assert ended.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("fabriclite report: error: --beside") and "needs --format perfetto" in err[0]
    assert "cannot read the trace" in err[1] and "export_chrome_trace" in err[1], err


def test_under_fault_tolerant_each_node_counts_only_its_own_checkpoints():
    """Each node is a replica group whose rank 0 writes its own checkpoint events: none is counted twice."""
    records = [dict(r, node=node) for node in (0, 1) for r in v1_crash_and_restart()]
    history = job_history.build(records, "r1")
    single = goodput.measure(v1_crash_and_restart())
    assert history.goodput[0] == history.goodput[1] == single and history.count("checkpoint") == 2
