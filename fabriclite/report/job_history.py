"""A job's history read back from its events record (fabriclite/supervision/watch/events.py): every node's file of one
run, as launches, rounds, step rates and marks (failures, restarts, preemptions, requeues, checkpoints, restores,
hangs, stragglers), with the goodput of each node. Reads schema ``fabriclite.events/2`` and ``/1`` (version 1 has
no ``steps`` events and no command or engine fields: the rates are each round's average, and those fields are
absent); lines of any other schema are skipped."""
from __future__ import annotations

import glob
import json
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from fabriclite.supervision.watch.goodput import Goodput, measure

#: the schema versions this reader understands
SCHEMAS = ("fabriclite.events/1", "fabriclite.events/2")
#: the kinds of marks, in the order the page's legend lists them
MARK_KINDS = ("failure", "restart", "preemption", "requeue", "checkpoint", "restore", "hang", "straggler")


@dataclass
class Mark:
    """One event on the timeline: ``time`` is when it happened (a checkpoint's: when its save began, ``duration``
    the time it held the loop); ``rank`` the global rank it concerns, None for the node as a whole."""

    kind: str
    time: float
    node: int
    rank: Optional[int]
    round: Optional[int]
    label: str
    detail: str = ""
    duration: float = 0.0
    index: int = 0  # its position in the record, shared with the page's event table


@dataclass
class Round:
    """A restart round of one node's ranks (``launch``: which launch of the run it belongs to)."""

    node: int
    launch: int
    number: int
    start: float
    end: Optional[float] = None
    up: Optional[float] = None  # the slowest rank's first step done
    last_step: Optional[float] = None
    steps: int = 0
    exit_code: Optional[int] = None
    failed: bool = False
    preempted: bool = False

    @property
    def outcome(self) -> str:
        """``ok``, ``failed``, ``preempted`` or ``running`` (no ``round_end``: a supervisor killed)."""
        if self.failed or (self.exit_code not in (None, 0, 75) and not self.preempted):
            return "failed"
        if self.preempted:
            return "preempted"
        return "running" if self.end is None else "ok"


@dataclass
class Launch:
    """One supervisor's life on one node (``number``: 0 for the run's first launch on that node)."""

    node: int
    number: int
    start: float
    end: Optional[float] = None
    exit_code: Optional[int] = None
    ranks: int = 0
    pid: Optional[int] = None
    fields: Dict[str, Any] = field(default_factory=dict)  # the job_start event's own fields
    schema: str = SCHEMAS[-1]


@dataclass
class StepRate:
    """Optimizer steps per second of ``rank`` from ``start`` to ``end``: a ``steps`` event's (schema 2), or with
    ``rank`` None the node's average over a round (from ``ranks_up`` to ``round_end``, any schema)."""

    node: int
    rank: Optional[int]
    round: Optional[int]
    start: float
    end: float
    per_second: float
    steps: int


@dataclass
class JobHistory:
    """Everything the report shows of one run."""

    run: str
    sources: List[str]
    schemas: List[str]
    other_runs: Dict[str, int]  # run id: events, of the runs the same files hold besides this one
    events: List[Dict[str, Any]]  # the run's events, by time
    nodes: List[int]
    ranks: Dict[int, List[int]]  # node: its global ranks
    launches: List[Launch]
    rounds: List[Round]
    rates: List[StepRate]
    marks: List[Mark]
    goodput: Dict[int, Goodput]
    unfinished: List[Launch]  # launches with no job_end (a killed supervisor, or a job still running)
    start: float = 0.0
    end: float = 0.0

    @property
    def command(self) -> Optional[List[str]]:
        """The ranks' command of the latest launch that recorded one (schema 2)."""
        for launch in reversed(self.launches):
            if launch.fields.get("command"):
                return list(launch.fields["command"])
        return None

    @property
    def engine(self) -> Dict[str, Any]:
        """What launched the job, from the ``job_start`` events: schema 2's ``host`` (node 0's) and, under SLURM,
        ``slurm_job_id`` and ``slurm_restart_count``, under torchrun ``torchrun_restart_count`` (the latest launch's);
        schema 1's ``launch`` (the restart count of whichever of the two); ``launches``: how many supervisors
        started on node 0."""
        found: Dict[str, Any] = {}
        first = min(self.nodes, default=0)
        for launch in self.launches:
            keys = ("slurm_job_id", "slurm_restart_count", "torchrun_restart_count") + (
                ("host",) if launch.node == first else ())
            for key in keys:
                if launch.fields.get(key) is not None:
                    found[key] = launch.fields[key]
            if launch.schema == SCHEMAS[0] and "launch" in launch.fields:
                found["launch"] = launch.fields["launch"]
        found["launches"] = sum(1 for launch in self.launches if launch.node == first)
        return found

    def count(self, kind: str) -> int:
        """How many marks of ``kind`` (one per event of that kind in the record)."""
        return sum(1 for m in self.marks if m.kind == kind)


def event_files(sources: Sequence[str]) -> List[str]:
    """The events files of ``sources``: each a file, or a folder whose ``events-node*.jsonl`` (else ``*.jsonl``)
    are taken. ValueError naming the source that is missing or holds none."""
    if not sources:
        raise ValueError("no run folder or events file given; pass a run folder or events-node<N>.jsonl files.")
    files: List[str] = []
    for source in sources:
        if os.path.isdir(source):
            found = sorted(glob.glob(os.path.join(source, "events-node*.jsonl"))) or sorted(
                glob.glob(os.path.join(source, "*.jsonl")))
            if not found:
                raise ValueError(f"{source!r} holds no events files (events-node<N>.jsonl); pass a run folder or the "
                                 "files themselves.")
            files.extend(found)
        elif os.path.isfile(source):
            files.append(source)
        else:
            raise ValueError(f"{source!r} does not exist; pass a run folder or events-node<N>.jsonl files.")
    return list(dict.fromkeys(os.path.abspath(f) for f in files))


def read_records(paths: Iterable[str]) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Every event of a known schema in ``paths`` (lines of other schemas, or not JSON, are skipped), and the
    schemas seen. ValueError when none is of a known schema (naming what was found instead)."""
    records: List[Dict[str, Any]] = []
    seen, unknown = set(), set()
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(record, dict):
                    continue
                schema = str(record.get("schema", ""))
                if schema in SCHEMAS and isinstance(record.get("time"), (int, float)) and record.get("event"):
                    seen.add(schema)
                    records.append(record)
                elif schema.startswith("fabriclite.events/"):
                    unknown.add(schema)
    if not records:
        newer = f" (found {', '.join(sorted(unknown))}: written by a newer fabriclite)" if unknown else ""
        raise ValueError(f"no fabriclite events ({' or '.join(SCHEMAS)}) in {', '.join(paths)}{newer}.")
    return records, sorted(seen)


def load(sources: Sequence[str], run: Optional[str] = None) -> JobHistory:
    """The history of run ``run`` (default: the run of the latest event) in ``sources`` (see :func:`event_files`).
    ValueError for a missing source, no events, or a run id the files do not hold (naming those they do)."""
    paths = event_files(sources)
    records, schemas = read_records(paths)
    counts: Dict[str, int] = {}
    for r in records:
        counts[str(r.get("run"))] = counts.get(str(r.get("run")), 0) + 1
    if run is None:
        run = str(max(records, key=lambda r: float(r["time"])).get("run"))
    elif run not in counts:
        raise ValueError(f"run {run!r} is not in {', '.join(paths)}; it holds the runs {', '.join(sorted(counts))}.")
    mine = sorted((r for r in records if str(r.get("run")) == run), key=lambda r: float(r["time"]))
    history = build(mine, run)
    history.sources, history.schemas = paths, schemas
    history.other_runs = {k: v for k, v in sorted(counts.items()) if k != run}
    return history


def build(records: List[Dict[str, Any]], run: str) -> JobHistory:
    """The history of one run's events (any order, any nodes)."""
    events = sorted(records, key=lambda r: float(r["time"]))
    history = JobHistory(run=run, sources=[], schemas=[], other_runs={}, events=events, nodes=[], ranks={},
                         launches=[], rounds=[], rates=[], marks=[], goodput={}, unfinished=[])
    nodes = sorted({int(e.get("node", 0)) for e in events})
    history.nodes = nodes
    positions = {id(e): i for i, e in enumerate(events)}
    saving = ("checkpoint", "restore")
    for node in nodes:
        own = [e for e in events if int(e.get("node", 0)) == node]
        _node_history(history, node, own, positions)
        # checkpoints and restores are global rank 0's, in its node's file, but they hold every node's loop; under
        # --fault-tolerant each node (a replica group) has its own, and takes no other's
        if not any(e["event"] in saving for e in own):
            own = [e for e in events if e["event"] in saving or int(e.get("node", 0)) == node]
        history.goodput[node] = measure(_closed(own))
    history.marks.sort(key=lambda m: (m.time, m.index))
    history.launches.sort(key=lambda l: (l.start, l.node))
    history.rounds.sort(key=lambda r: (r.start, r.node))
    times = [float(e["time"]) for e in events] + [m.time for m in history.marks]
    history.start, history.end = (min(times), max(times)) if times else (0.0, 0.0)
    for launch in history.launches:  # the global ranks of each node: node * ranks per node + local rank
        if launch.ranks:
            history.ranks.setdefault(launch.node, list(range(launch.node * launch.ranks,
                                                             (launch.node + 1) * launch.ranks)))
    for item in [*history.marks, *history.rates]:
        if item.rank is not None and item.rank not in history.ranks.get(item.node, []):
            history.ranks.setdefault(item.node, []).append(item.rank)
            history.ranks[item.node].sort()
    return history


def _node_history(history: JobHistory, node: int, events: List[Dict[str, Any]], positions: Dict[int, int]) -> None:
    launch: Optional[Launch] = None
    launches: List[Launch] = []
    rounds: Dict[Tuple[int, int], Round] = {}
    current: Optional[Round] = None
    for e in events:
        kind, t = e["event"], float(e["time"])
        index = positions[id(e)]
        if kind == "job_start":
            if launch is not None and launch.end is None:
                history.unfinished.append(launch)
            launch = Launch(node, len(launches), t, ranks=int(e.get("ranks") or 0), pid=e.get("pid"),
                            fields={k: v for k, v in e.items() if k not in ("schema", "run", "time", "node", "event")},
                            schema=str(e.get("schema")))
            launches.append(launch)
            current = None
        elif kind == "job_end" and launch is not None:
            launch.end, launch.exit_code = t, e.get("exit_code")
        elif kind == "round_start":
            current = Round(node, launch.number if launch else 0, int(e.get("round", 0)), t)
            rounds[(current.launch, current.number)] = current
        elif kind == "ranks_up" and current is not None:
            current.up = float(e.get("first_step") or t)
        elif kind == "round_end":
            r = rounds.get((launch.number if launch else 0, int(e.get("round", 0)))) or current
            if r is not None:
                r.end, r.exit_code, r.steps = t, e.get("exit_code"), int(e.get("steps") or 0)
                r.last_step = float(e["last_step"]) if e.get("last_step") else None
                if r.up is None and e.get("first_step"):
                    r.up = float(e["first_step"])
                if r.up is not None and r.last_step is not None and r.steps > 1 and r.last_step > r.up:
                    history.rates.append(StepRate(node, None, r.number, r.up, r.last_step,
                                                  (r.steps - 1) / (r.last_step - r.up), r.steps))
        elif kind == "steps":
            _steps_event(history, node, e, t)
        mark = _mark(e, node, index)
        if mark is not None:
            history.marks.append(mark)
            if mark.kind == "failure" and current is not None:
                current.failed = True
            if mark.kind in ("preemption", "requeue") and current is not None:
                current.preempted = True
    if launch is not None and launch.end is None:
        history.unfinished.append(launch)
    history.launches.extend(launches)
    history.rounds.extend(rounds.values())


def _steps_event(history: JobHistory, node: int, e: Dict[str, Any], t: float) -> None:
    """A version-2 ``steps`` event: each rank's steps per second over the ``seconds`` before ``t``."""
    seconds = float(e.get("seconds") or 0.0)
    steps = e.get("steps") or {}
    for rank, rate in (e.get("per_second") or {}).items():
        history.rates.append(StepRate(node, int(rank), e.get("round"), t - seconds, t, float(rate),
                                      int(steps.get(rank, 0))))


def _closed(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``events`` (by time) with a ``job_end`` at the last event of each launch that has none (a supervisor killed,
    or a job still running), so that goodput measures the time the record covers, not the time until now."""
    closed: List[Dict[str, Any]] = []
    open_launch = False
    for e in events:
        if e["event"] == "job_start" and open_launch:
            closed.append({**closed[-1], "event": "job_end", "exit_code": None})
        closed.append(e)
        if e["event"] == "job_start":
            open_launch = True
        elif e["event"] == "job_end":
            open_launch = False
    if open_launch:
        closed.append({**closed[-1], "event": "job_end", "exit_code": None})
    return closed


def _signal_name(number: Any) -> str:
    try:
        return signal.Signals(int(number)).name
    except (TypeError, ValueError):
        return str(number)


def _size(n: Any) -> str:
    value = float(n or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"


def _mark(e: Dict[str, Any], node: int, index: int) -> Optional[Mark]:
    """The timeline mark of one event, or None for events drawn otherwise (rounds, launches, rates)."""
    kind, t, r = e["event"], float(e["time"]), e.get("round")
    if kind == "failure":
        rank = e.get("rank")
        who = f"rank {rank}" if rank is not None else f"node {node}"
        hang = " (a hang)" if e.get("hang") else ""
        return Mark("failure", t, node, rank, r, f"{who} failed{hang}, exit code {e.get('exit_code')}",
                    str(e.get("cause") or ""), index=index)
    if kind == "restart":
        return Mark("restart", t, node, None, r, f"restart: round {r} after a {e.get('backoff') or 0} s backoff",
                    index=index)
    if kind == "preemption_notice":
        return Mark("preemption", t, node, None, r, f"preemption notice: {_signal_name(e.get('signal'))}",
                    index=index)
    if kind == "requeue":
        return Mark("requeue", t, node, None, r, f"requeue asked (exit code {e.get('exit_code')})", index=index)
    if kind == "checkpoint":
        blocked = float(e.get("blocked", e.get("seconds", 0.0)) or 0.0)
        path = str(e.get("path") or "")
        return Mark("checkpoint", t - blocked, node, 0, r,
                    f"checkpoint at step {e.get('step')}: {os.path.basename(path.rstrip('/')) or path}, "
                    f"{_size(e.get('bytes'))}, held the loop {blocked:.2f} s", path, duration=blocked, index=index)
    if kind == "restore":
        seconds = float(e.get("seconds") or 0.0)
        source = e.get("source")
        what = "nothing to resume from" if source is None else f"restored from {source}"
        group = f" (replica group {e['group']})" if e.get("group") is not None else ""
        return Mark("restore", t - seconds, node, 0, r, f"{what}{group} in {seconds:.2f} s", duration=seconds,
                    index=index)
    if kind == "hang":
        return Mark("hang", t, node, None, r, f"hang: {e.get('reason') or ''}".strip(), str(e.get("stacks") or ""),
                    index=index)
    if kind == "straggler":
        return Mark("straggler", t, int(e.get("node", node)), e.get("rank"), r,
                    f"straggler: rank {e.get('rank')} {100 * float(e.get('slower') or 0):.0f}% slower than the "
                    f"median over {e.get('windows')} windows", index=index)
    return None
