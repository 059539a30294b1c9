"""What a rank started by a fabriclite supervisor does for it: report its traceback to an error
file, and end when the supervisor dies."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from types import TracebackType
from typing import Optional, Type

ERROR_FILE_ENV = "FABRICLITE_ERROR_FILE"
SUPERVISOR_PID_ENV = "FABRICLITE_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux); exit now if the parent
    is already gone. Safe to call in a preexec_fn."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def write_error_file(path: str, exc: BaseException, tb: Optional[TracebackType] = None) -> None:
    """Record ``exc`` with its traceback for the supervisor's summary (first writer wins)."""
    if os.path.exists(path):
        return
    record = {
        "rank": os.environ.get("FABRICLITE_RANK"),
        "exc_type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__)),
        "timestamp": time.time(),
        "pid": os.getpid(),
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def record_errors() -> None:
    """In a supervised rank: write uncaught exceptions to the error file, then report as usual."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or getattr(sys.excepthook, "_fabriclite", False):
        return
    previous = sys.excepthook

    def hook(exc_type: Type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        try:
            write_error_file(path, exc, tb)
        finally:
            previous(exc_type, exc, tb)

    hook._fabriclite = True  # type: ignore[attr-defined]
    sys.excepthook = hook
