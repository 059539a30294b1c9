"""A job's history (job_history.py) as Chrome trace-event JSON, which Perfetto and ``chrome://tracing`` open, so that
a job's control events can sit beside a torch profiler trace. Times are unix microseconds; merged into a profiler
trace (``--beside``), they move to that trace's time base.

Each node is a process (``pid`` = node, named "fabriclite node N"); its supervisor is thread 0 and global rank R
is thread R + 1. Launches, rounds and their start-ups are complete (``X``) events on the supervisor's thread
(nested), checkpoints and restores are ``X`` events on rank 0's, every other mark is an instant (``i``) event, on
its rank's thread or, for the node as a whole, on the process; steps per second is a counter (``C``) per rank.
Every event has ``name``, ``ph``, ``ts``, ``pid`` and ``tid``; ``X`` events also ``dur``; names of processes and
threads are metadata (``M``) events.
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Any, Dict, List, Optional

from fabriclite.report.job_history import JobHistory

SUPERVISOR_TID = 0


def _us(t: float) -> float:
    return round(t * 1e6, 1)


def _tid(rank: Optional[int]) -> int:
    return SUPERVISOR_TID if rank is None else int(rank) + 1


def trace_events(history: JobHistory) -> List[Dict[str, Any]]:
    """The trace's events (see the module docstring)."""
    out: List[Dict[str, Any]] = []

    def meta(what: str, pid: int, tid: int, **args: Any) -> None:
        out.append({"name": what, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args})

    def complete(what: str, start: float, end: float, pid: int, tid: int, cat: str, args: Dict[str, Any]) -> None:
        out.append({"name": what, "cat": cat, "ph": "X", "ts": _us(start), "dur": max(0.0, _us(end) - _us(start)),
                    "pid": pid, "tid": tid, "args": args})

    for node in history.nodes:
        meta("process_name", node, SUPERVISOR_TID, name=f"fabriclite node {node}")
        meta("process_sort_index", node, SUPERVISOR_TID, sort_index=node)
        meta("thread_name", node, SUPERVISOR_TID, name="supervisor")
        for rank in history.ranks.get(node, []):
            meta("thread_name", node, _tid(rank), name=f"rank {rank}")
    for launch in history.launches:
        end = launch.end if launch.end is not None else history.end
        complete(f"launch {launch.number}", launch.start, end, launch.node, SUPERVISOR_TID, "launch",
                 {**launch.fields, "exit_code": launch.exit_code})
    for r in history.rounds:
        end = r.end if r.end is not None else history.end
        complete(f"round {r.number}", r.start, end, r.node, SUPERVISOR_TID, "round",
                 {"outcome": r.outcome, "steps": r.steps, "exit_code": r.exit_code, "launch": r.launch})
        complete("start-up", r.start, min(r.up if r.up is not None else end, end), r.node, SUPERVISOR_TID, "round",
                 {"round": r.number})
    for mark in history.marks:
        args = {"label": mark.label, "round": mark.round, **({"detail": mark.detail} if mark.detail else {})}
        if mark.duration > 0:
            complete(mark.kind, mark.time, mark.time + mark.duration, mark.node, _tid(mark.rank), mark.kind, args)
        else:
            out.append({"name": mark.kind, "cat": mark.kind, "ph": "i", "ts": _us(mark.time), "pid": mark.node,
                        "tid": _tid(mark.rank), "s": "t" if mark.rank is not None else "p", "args": args})
    for rate in history.rates:
        if rate.rank is None:
            continue
        out.append({"name": f"steps/s rank {rate.rank}", "ph": "C", "ts": _us(rate.start), "pid": rate.node,
                    "tid": _tid(rate.rank), "args": {"steps/s": round(rate.per_second, 3)}})
    return out


def trace(history: JobHistory, beside: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The whole trace document: ``traceEvents`` and what identifies the run. With ``beside`` (a torch profiler
    trace, as ``prof.export_chrome_trace`` writes it), one document with that trace's events and ours, ours moved to
    its time base: Kineto writes times relative to its ``baseTimeNanoseconds``."""
    events = trace_events(history)
    about = {"run": history.run, "command": history.command, "engine": history.engine, "schemas": history.schemas}
    if beside is None:
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": about}
    base_us = float(beside.get("baseTimeNanoseconds") or 0) / 1000
    for e in events:
        if e["ph"] != "M":
            e["ts"] = round(e["ts"] - base_us, 1)
    return {**beside, "traceEvents": [*beside["traceEvents"], *events],
            "otherData": {**(beside.get("otherData") or {}), "fabriclite": about}}


def read_trace(path: str) -> Dict[str, Any]:
    """A Chrome trace-event JSON document (``.json`` or ``.json.gz``), such as a torch profiler trace; ValueError
    naming ``path`` when it cannot be read or holds no ``traceEvents`` list."""
    try:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            document = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read the trace {path!r} ({err}); pass a torch profiler trace "
                         "(prof.export_chrome_trace).") from None
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ValueError(f"{path!r} is not a Chrome trace-event document (no traceEvents list); pass a torch "
                         "profiler trace (prof.export_chrome_trace).")
    return document


def write(history: JobHistory, path: str, beside: Optional[Dict[str, Any]] = None) -> str:
    """Write the trace (merged with ``beside``, see :func:`trace`) to ``path``; its absolute path."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace(history, beside), f, default=str)
    return path
