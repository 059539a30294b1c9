"""What a supervisor knows about failed ranks, and the one summary it prints for a failed job.

A rank's failure comes from its exit status and, when it raised, from the error file it wrote
(traceback, time, and whether the error only reports a lost peer: "secondary"). The root cause is
the earliest failure that is not secondary, on this node or, across nodes, the one a supervisor
published in the job's store.
"""
from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from fabriclite.distributed.control_plane.failure_flag import failure_line


@dataclass
class Failure:
    """One rank that exited non-zero, was killed by a signal (``returncode`` < 0), or raised and is
    still exiting (``returncode`` None; its error file says what it raised)."""

    node_rank: int
    global_rank: int
    local_rank: int
    returncode: Optional[int]
    traceback: str = ""
    timestamp: float = field(default_factory=time.time)
    secondary: bool = False
    #: "ValueError: boom", from the error file
    error: str = ""

    @classmethod
    def from_exit(cls, node_rank: int, global_rank: int, local_rank: int, returncode: Optional[int],
                  error_file: str, noticed_after_s: float = 0.0) -> "Failure":
        """The failure of a rank that ended with ``returncode``, completed from its error file if it
        wrote one (``noticed_after_s``: how late the exit may have been seen, for the time)."""
        failure = cls(node_rank, global_rank, local_rank, returncode, timestamp=time.time() - noticed_after_s)
        try:
            with open(error_file) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return failure
        failure.traceback = record.get("traceback", "")
        if record.get("exc_type"):
            failure.error = f"{record['exc_type']}: {record.get('message', '')}".rstrip(": ")
        failure.timestamp = float(record.get("timestamp", failure.timestamp))
        failure.secondary = bool(record.get("secondary", False))
        return failure

    def describe(self) -> str:
        """"rank 1 (local rank 1, node 0) raised ValueError: boom (exit code 1)", "... exited with
        code 3", "... was killed by SIGKILL"."""
        code = self.returncode
        if self.error_line:
            how = f"raised {self.error_line}" + (f" (exit code {code})" if code is not None and code > 0 else "")
            if code is not None and code < 0:
                how += f" and was killed by {signal_name(-code)}"
        elif code is None:
            how = "raised an exception"
        else:
            how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
        return f"rank {self.global_rank} (local rank {self.local_rank}, node {self.node_rank}) {how}"

    @property
    def error_line(self) -> str:
        """What the rank raised (``ValueError: boom``), or ""."""
        if self.error:
            return self.error
        lines = self.traceback.strip().splitlines()
        return lines[-1] if lines else ""

    @property
    def exit_code(self) -> int:
        """The code the job exits with when this is its root cause (128 + signal for a signal)."""
        code = self.returncode
        if code is None:  # it raised: Python's exit code for an uncaught exception
            return 1
        return code if code > 0 else 128 + (-code if code < 0 else 1)

    def record(self) -> Dict[str, Any]:
        """What goes into the job's store for the other nodes (see control_plane.failure_flag.publish_failure)."""
        return {"node": self.node_rank, "rank": self.global_rank, "message": self.describe(),
                "timestamp": self.timestamp, "secondary": self.secondary}


def root_cause(failures: Sequence[Failure]) -> Failure:
    """The earliest failure that is not secondary (else the earliest)."""
    return min(failures, key=lambda f: (f.secondary, f.timestamp))


def remote_is_root(remote: Optional[Dict[str, Any]], local_root: Failure, node_rank: int) -> bool:
    """Whether a failure published by another node explains the job better than ``local_root``."""
    if remote is None or remote.get("node") == node_rank:
        return False
    if local_root.secondary:
        return not remote.get("secondary", False) or float(remote.get("timestamp", 0)) < local_root.timestamp
    return not remote.get("secondary", False) and float(remote.get("timestamp", 0)) < local_root.timestamp


def summarize(failures: Sequence[Failure], remote: Optional[Dict[str, Any]], node_rank: int,
              stopping: List[int], finished: Sequence[int] = ()) -> str:
    """The job's one summary: the root cause first, the other failed ranks, the ranks that had
    already exited with code 0 (``finished``: leaving early breaks the others' collectives), the
    ranks being stopped, and the root cause's traceback."""
    root = root_cause(failures)
    lines: List[str] = []
    if remote_is_root(remote, root, node_rank):
        assert remote is not None
        lines.append(f"fabriclite: {failure_line(remote)}")
        others = list(failures)
    else:
        lines.append(f"fabriclite: the job failed: {root.describe().rstrip('.')}.")
        others = [f for f in failures if f is not root]
    for f in others:
        lines.append(f"  also: {f.describe()}")
    if finished:
        lines.append(f"  ranks {list(finished)} on node {node_rank} had already exited with code 0 (a rank that "
                     f"leaves while the others still run collectives makes them fail).")
    if stopping:
        lines.append(f"  stopping ranks {stopping} on node {node_rank}.")
    shown = root if root.traceback and root not in others else next((f for f in others if f.traceback), None)
    if shown is not None:
        lines.append(f"--- rank {shown.global_rank} traceback ---")
        lines.append(shown.traceback.rstrip())
    return "\n".join(lines)


def signal_name(signum: int) -> str:
    """"SIGTERM" for 15; "signal 99" for what is not a known signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
