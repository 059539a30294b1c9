"""What a rank started by a fabriclite supervisor does for it: report its traceback to an error
file, and end when the supervisor dies."""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any, Callable, Optional, Type

ERROR_FILE_ENV = "FABRICLITE_ERROR_FILE"
SUPERVISOR_PID_ENV = "FABRICLITE_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1
#: parts of the messages of errors that only report that *another* rank is gone (gloo, nccl, c10d)
PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                     "pair closure", "socket closed", "connection refused", "nccl communicator was aborted")


_prctl: Optional[Callable[..., int]] = None


def load_prctl() -> None:
    """Resolve prctl(2) now, in the parent: a forked child (a preexec_fn) must not dlopen anything
    while other threads of the parent may hold the loader's locks."""
    global _prctl
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            pass


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux); exit now if the parent
    is already gone. Safe in a preexec_fn once the parent called ``load_prctl()``."""
    load_prctl()
    if _prctl is None:  # pragma: no cover - not Linux
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def watch_supervisor(supervisor_pid: int) -> None:
    """End this process (SIGKILL) as soon as ``supervisor_pid`` exits, whether it is the parent
    (PR_SET_PDEATHSIG) or not (a forkserver child: a daemon thread waits on a pidfd, or polls).
    Exits now if the supervisor is already gone."""
    if os.getppid() == supervisor_pid:
        die_with_parent(supervisor_pid)
        return
    try:
        fd: Optional[int] = os.pidfd_open(supervisor_pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        fd = None
        if not _alive(supervisor_pid):
            os._exit(1)

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _alive(supervisor_pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fabriclite-supervisor-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def is_secondary(exc: BaseException) -> bool:
    """Whether ``exc`` only reports that another rank is gone (so it is not the job's root cause)."""
    if getattr(exc, "secondary", False):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in PEER_LOST_MARKERS)


def write_error_file(path: str, exc: BaseException, tb: Optional[TracebackType] = None) -> None:
    """Record ``exc`` with its traceback for the supervisor's summary (first writer wins); an error
    that only reports a lost peer is marked ``secondary``, so the summary leads with the root cause."""
    if os.path.exists(path):
        return
    record = {
        "rank": os.environ.get("FABRICLITE_RANK"),
        "exc_type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__)),
        "timestamp": time.time(),
        "pid": os.getpid(),
        "secondary": is_secondary(exc),
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def exit_on_error(fn: Callable[[], Any]) -> None:
    """Run ``fn`` (an exit handler: ``atexit.register(exit_on_error, fn)``); if it raises, report the error as
    an uncaught one would be (traceback on stderr, the rank's error file) and end the process with exit code 1.
    An exception in an atexit handler is otherwise printed and ignored: the process would exit 0."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - reported, then the process fails
        sys.excepthook(type(exc), exc, exc.__traceback__)
        path = os.environ.get(ERROR_FILE_ENV)
        if path:
            write_error_file(path, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def record_errors() -> None:
    """In a supervised rank: write uncaught exceptions to the error file, then report as usual."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or getattr(sys.excepthook, "_fabriclite", False):
        return
    previous = sys.excepthook

    def hook(exc_type: Type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        try:
            write_error_file(path, exc, tb)
            wait_for_stacks(path, exc)
        finally:
            previous(exc_type, exc, tb)

    hook._fabriclite = True  # type: ignore[attr-defined]
    sys.excepthook = hook


#: where this rank's stack dump goes (set per rank by the supervisor; read once, then removed from the environment
#: so that the rank's own child processes do not register onto the same file)
STACK_FILE_ENV = "FABRICLITE_STACK_FILE"
#: the signal that makes a rank write every thread's Python stack to its stack file (faulthandler, in C: it works
#: while the main thread is blocked inside a collective, and while the rank is still importing torch)
STACK_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
_stack_file: Any = None


def install_stack_handler() -> bool:
    """Register faulthandler on :data:`STACK_SIGNAL` to this rank's stack file (``$FABRICLITE_STACK_FILE``), all
    threads, not chained; creating the file says the handler is installed (the supervisor signals only then).
    Runs in the rank's bootstrap before torch or the script is imported (``sitecustomize`` on the supervisor's
    ``PYTHONPATH`` entry, see supervision/watch/stacks.py). Returns whether a handler was installed."""
    global _stack_file
    import faulthandler

    path = os.environ.pop(STACK_FILE_ENV, None)
    if not path or _stack_file is not None:
        return False
    try:
        _stack_file = open(f"{path}.{os.getpid()}.tmp", "w")
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
        os.replace(_stack_file.name, path)  # the file appears only once the handler is in place
    except (OSError, ValueError, RuntimeError):
        return False
    return True


#: how long a rank that reports a collective timeout waits for its supervisor to take the other ranks' stacks
#: before it goes on exiting (its exit would break the others' collectives, and change what their stacks show)
STACKS_WAIT_S = 20.0
_TIMEOUT_WORDS = ("timed out", "timeout")


def is_timeout_error(exc: BaseException) -> bool:
    """Whether ``exc`` reports a collective timeout (fabriclite's CollectiveTimeout, the backend's own)."""
    return type(exc).__name__ == "CollectiveTimeout" or any(w in str(exc).lower() for w in _TIMEOUT_WORDS)


def stacks_marker(error_file: str) -> str:
    """The file the supervisor creates once it has taken the stacks after the error in ``error_file``."""
    return f"{error_file}.stacks"


def wait_for_stacks(error_file: str, exc: BaseException) -> None:
    """After a collective timeout, stay (up to STACKS_WAIT_S) until the supervisor has taken the live ranks'
    stacks, so that they show where the others were when this rank gave up (supervision/watch/hangs.py)."""
    if not is_timeout_error(exc) or is_secondary(exc) or SUPERVISOR_PID_ENV not in os.environ:
        return
    deadline = time.monotonic() + STACKS_WAIT_S
    while not os.path.exists(stacks_marker(error_file)) and time.monotonic() < deadline:
        time.sleep(0.02)


def stop_marker(error_file: str) -> str:
    """The file a supervisor creates beside its ranks' error files before it stops them with SIGTERM."""
    return os.path.join(os.path.dirname(error_file), "stopping")
