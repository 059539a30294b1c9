"""Letting gloo's worker threads go idle before a rank's process group is destroyed or its interpreter ends.

gloo runs each collective on a worker thread of its own (named ``pt_gloo_runloop``) and drops its reference to the
finished work a moment *after* the caller's ``wait()`` returns. Dropping it releases the work's tensors, and with
torch's PyObject preservation that takes the GIL. If the rank has meanwhile reached interpreter shutdown, taking the
GIL ends the worker thread inside a C++ destructor and the whole process dies of SIGABRT ("terminate called without
an active exception", pytorch#179291 / #190489): a finished job reported as a crash. (Dropping the group's last
reference at that moment is no cure: its destructor joins the worker from a thread that holds the GIL the worker
is waiting for.)

``destroy_process_group`` does not stop gloo's threads while anything (a DDP or FSDP module, say) still refers to
the group, so the only safe point is before teardown: wait, with the GIL released, until no worker is running.
"""
from __future__ import annotations

import os
import time

#: the name torch gives gloo's worker threads (Linux: /proc/self/task/<tid>/comm)
WORKER_NAME = "pt_gloo_runloop"
_TASKS = "/proc/self/task"


def running_workers(name: str = WORKER_NAME) -> int:
    """How many of this process's threads called ``name`` are running or runnable now (0 where /proc is absent)."""
    count = 0
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended while we looked
        count += state == "R"
    return count


def wait_for_idle_workers(timeout_s: float = 2.0, settle: int = 3, poll_s: float = 0.002,
                          name: str = WORKER_NAME) -> bool:
    """Sleep (GIL released) until no thread called ``name`` has run on ``settle`` polls in a row, ``poll_s``
    apart; True then, False after ``timeout_s`` with a worker still running. A worker waiting for the GIL gets it
    during the sleeps, finishes, and goes back to waiting for work. Without /proc (not Linux) it sleeps one
    settle period and returns True."""
    if not os.path.isdir(_TASKS):
        time.sleep(settle * poll_s)
        return True
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < settle:
        time.sleep(poll_s)
        quiet = 0 if running_workers(name) else quiet + 1
        if quiet < settle and time.monotonic() > deadline:
            return False
    return True
