"""How a supervisor stops and reaps its ranks, and ends its own process."""
from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any, NoReturn


def kill_group(pid: int, sig: int) -> None:
    """Signal the rank's process group (the rank and what it started); the rank alone if it has not
    made its own group yet."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap(worker: Any) -> None:
    """Wait up to 5 s for ``worker`` (already SIGKILLed) to be reaped."""
    deadline = time.monotonic() + 5
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def exit_process(code: int) -> NoReturn:
    """End this (supervisor) process with ``code`` now: run the atexit handlers and flush stdio, but
    skip the interpreter's teardown of torch's modules (a second or more on a busy machine)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    os._exit(code)


def print_summary(summary: str) -> None:
    """Print the supervisor's summary (if any) to stderr."""
    if summary:
        print(summary, file=sys.stderr, flush=True)
