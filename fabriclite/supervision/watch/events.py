"""The job's events record: one JSON-lines file per node, appended across fabriclite restarts, SLURM requeues and
torchrun restarts, with the run's id on every line (docs/reliability.md, "Events and goodput").

Where: ``<log dir>/events-node<N>.jsonl``, the log dir being ``fabriclite run --log-dir`` / ``$FABRICLITE_LOG_DIR``,
else the run's own folder outside the working directory (:func:`run_folder`:
``$XDG_STATE_HOME/fabriclite/runs/<run id>/``, ``~/.local/state/...`` by default): nothing is written where the user
did not point. ``$FABRICLITE_EVENTS=0`` turns it off.

Schema (version :data:`SCHEMA`): every line is one JSON object with ``schema``, ``run`` (the run's id: the same
across restarts and requeues), ``time`` (unix seconds), ``node``, ``event`` and the event's own fields:

=====================  =====================================================================================
``job_start``          a supervisor started (``launch``: how many times this run was launched before: SLURM's
                       ``SLURM_RESTART_COUNT``, torchrun's ``TORCHELASTIC_RESTART_COUNT``; ``ranks``, ``pid``;
                       since version 2 ``command``: the supervisor's command line, ``host``, ``slurm_job_id``,
                       ``slurm_restart_count``, ``torchrun_restart_count``: null outside SLURM / torchrun)
``round_start``        a restart round's ranks are started (``round``; 0 is the first start)
``ranks_up``           every rank of the node finished its first optimizer step (``round``, ``first_step``: when
                       the slowest did, ``seconds``: since ``round_start``)
``failure``            a round failed (``round``, ``rank``, ``cause``, ``exit_code``, ``hang``)
``hang``               a hang, with the live stacks (``round``, ``reason``, ``stacks``)
``round_end``          a round's ranks are stopped (``round``, ``exit_code``, ``steps``: optimizer steps its ranks
                       made, ``first_step``, ``last_step``: times)
``restart``            the next round is coming (``round``: the next one, ``backoff``: seconds)
``preemption_notice``  SIGTERM / SIGUSR1 reached the supervisor (``signal``)
``requeue``            the job asked to be requeued (``exit_code``)
``checkpoint``         a rank (global rank 0) saved (``path``, ``bytes``, ``seconds``, ``blocked``: how long the
                       loop waited, ``step``: its optimizer steps in this process, ``round``)
``restore``            a rank (global rank 0) loaded a checkpoint or a live peer's state (``source``, ``seconds``,
                       ``round``); under ``--fault-tolerant`` also ``group``: a heal
``straggler``          a rank slower than the median (``rank``, ``node``, ``slower``: fraction, ``windows``)
``steps``              (version 2) each rank's optimizer steps per second, every ``$FABRICLITE_STEPS_EVERY`` s
                       (default 10; 0: off) while they step (``round``, ``seconds``: the interval, ``steps`` and
                       ``per_second``: global rank -> steps in the round so far / per second over the interval)
``store_refused``      node 0's relay turned a connection away: no job secret proved (``peer``, ``why``; once per
                       peer host and reason)
``job_end``            the supervisor ends (``exit_code``)
=====================  =====================================================================================
"""
from __future__ import annotations

import getpass
import json
import os
import tempfile
import time
from typing import Any, Dict, Optional

SCHEMA = "fabriclite.events/2"
EVENTS_ENV = "FABRICLITE_EVENTS"
#: the file a supervisor's ranks append their own events to (checkpoints, restores)
EVENTS_FILE_ENV = "FABRICLITE_EVENTS_FILE"
LOG_DIR_ENV = "FABRICLITE_LOG_DIR"
#: the XDG base directory for state (logs, history) that the run folders live under
STATE_HOME_ENV = "XDG_STATE_HOME"


def enabled() -> bool:
    """False when ``$FABRICLITE_EVENTS`` is 0 / false / off."""
    return os.environ.get(EVENTS_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def run_folder(run_id: str) -> str:
    """Run ``run_id``'s folder when no log dir is given: ``$XDG_STATE_HOME/fabriclite/runs/<run id>/`` (an absolute
    ``$XDG_STATE_HOME``, else ``~/.local/state``), created here; where that cannot be written, the same under
    ``<tempdir>/fabriclite-<user>/runs/``."""
    state = os.environ.get(STATE_HOME_ENV, "")
    if not os.path.isabs(state):
        state = os.path.join(os.path.expanduser("~"), ".local", "state")
    roots = [os.path.join(state, "fabriclite", "runs"), os.path.join(tempfile.gettempdir(), f"fabriclite-{_user()}",
                                                                         "runs")]
    for root in roots:
        folder = os.path.join(root, run_id)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK | os.X_OK):
            return folder
    return folder


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def events_path(node_rank: int, run_id: str, log_dir: Optional[str] = None) -> str:
    """``<log dir>/events-node<N>.jsonl``: ``log_dir``, else ``$FABRICLITE_LOG_DIR``, else the run's folder
    (:func:`run_folder`; see the module docstring)."""
    directory = log_dir or os.environ.get(LOG_DIR_ENV) or run_folder(run_id)
    return os.path.join(directory, f"events-node{node_rank}.jsonl")


class EventLog:
    """Appends events to one node's file; every write is one ``O_APPEND`` line, so the supervisor and its ranks can
    share the file. Errors writing it are ignored (the record never fails a job)."""

    def __init__(self, path: str, run_id: str, node_rank: int) -> None:
        self.path, self.run_id, self.node_rank = path, run_id, node_rank

    def emit(self, event: str, **fields: Any) -> Dict[str, Any]:
        record = {"schema": SCHEMA, "run": self.run_id, "time": round(time.time(), 4), "node": self.node_rank,
                  "event": event, **fields}
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(record, default=str) + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass
        return record


def for_supervisor(node_rank: int, run_id: str, log_dir: Optional[str]) -> Optional[EventLog]:
    """The node's log, or None when turned off."""
    return EventLog(events_path(node_rank, run_id, log_dir), run_id, node_rank) if enabled() else None


_rank_log: Optional[EventLog] = None
_rank_opened = False


def for_rank() -> Optional[EventLog]:
    """In a rank: the node's log its supervisor named (``$FABRICLITE_EVENTS_FILE``); under torchrun or srun without
    a fabriclite supervisor, ``events-node<N>.jsonl`` in ``$FABRICLITE_LOG_DIR`` or the run's folder; else (a single
    process, ``mpirun``) or when off, None."""
    global _rank_log, _rank_opened
    if not _rank_opened:
        _rank_opened = True
        external = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_STEP_ID")
        if enabled() and (os.environ.get(EVENTS_FILE_ENV) or external):
            from fabriclite.distributed import rendezvous

            node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", "0")))
                       or 0)
            run_id = rendezvous.run_id()
            path = os.environ.get(EVENTS_FILE_ENV) or events_path(node, run_id)
            _rank_log = EventLog(path, run_id, node)
    return _rank_log


def read(path: str, run: Optional[str] = None) -> list:
    """The events in ``path`` (of run ``run`` only, if given), skipping lines that are not this schema's."""
    found = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if str(record.get("schema", "")).startswith("fabriclite.events/") and (run is None or
                                                                                 record.get("run") == run):
                found.append(record)
    return found


def _path_bytes(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return os.path.getsize(path) if os.path.exists(path) else 0


def _rank_round() -> int:
    raw = os.environ.get("FABRICLITE_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return int(raw) if raw.isdigit() else 0


def checkpoint_saved(global_rank: int, path: Any, started: float, steps: Optional[int]) -> None:
    """(Rank) ``fabric.save`` returned: a ``checkpoint`` event from global rank 0 (``started``: ``perf_counter``)."""
    if global_rank != 0:
        return
    log = for_rank()
    if log is None:
        return
    seconds = time.perf_counter() - started
    try:
        size = _path_bytes(os.fspath(path))
    except OSError:
        size = 0
    log.emit("checkpoint", path=os.fspath(path), bytes=size, seconds=round(seconds, 4), blocked=round(seconds, 4),
             step=steps, round=_rank_round())


def restored(global_rank: int, source: Optional[str], started: float) -> None:
    """(Rank) ``fabric.load_latest`` returned ``source``: a ``restore`` event from global rank 0; under
    ``--fault-tolerant`` with the group (a heal, when the source is a live peer)."""
    if global_rank != 0:
        return
    log = for_rank()
    if log is None:
        return
    fields: Dict[str, Any] = {"source": source, "seconds": round(time.perf_counter() - started, 4),
                              "round": _rank_round()}
    if os.environ.get("FABRICLITE_FT_GROUP"):
        fields["group"] = int(os.environ["FABRICLITE_FT_GROUP"])
    log.emit("restore", **fields)
