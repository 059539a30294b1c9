"""Preemption, on the ranks' side: record SIGTERM / the requeue signal (SIGUSR1 unless configured) instead of
dying, and agree on it.

A cluster says "you will be stopped soon" with SIGTERM (Kubernetes, SLURM at the time limit) or with the
signal the job asked for (SLURM ``--signal=USR1@90``). SLURM sends it to every process of the step, and
SIGUSR1's default action would kill a rank; so ``fabric.launch()`` installs handlers (where the program has
none of its own) that only record the first such signal. A fabriclite supervisor that receives one forwards it
to its ranks too, and gives them a grace period (see supervision/agent/preemption.py).

The requeue signal is ``SLURMEnvironment(requeue_signal=...)`` where srun started the ranks, else
``$FABRICLITE_REQUEUE_SIGNAL`` (``fabriclite run --requeue-signal``), else SIGUSR1. A program that already
handles it (submitit installs a SIGUSR2 handler that checkpoints and requeues) keeps its handler: fabriclite
neither records that signal nor requeues after it, and global rank 0 says so once.

Under torchrun only the requeue signal is recorded: torchrun's agent stops its workers with SIGTERM.

Under a fabriclite supervisor, SIGTERM also remains the supervisor's way to stop its ranks. Before it stops
them, the supervisor creates a ``stopping`` file beside the ranks' error files: a SIGTERM then ends the rank
at once, even while its main thread is blocked in C code (a thread woken by the signal's wakeup fd checks the
file), exactly as SIGTERM's default action did.

``check(strategy)`` turns the ranks' local records into one answer: an all_reduce (max) of one number, so
every rank gets the same bool at the same call.

Without a supervisor (srun, mpirun) under SLURM, global rank 0 runs ``scontrol requeue`` at exit after the
requeue signal (see environments/slurm.requeue), unless ``SLURMEnvironment(auto_requeue=False)`` or
``$FABRICLITE_REQUEUE=0``.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any, Optional, Tuple

import torch

from fabriclite.environments.slurm import SLURMEnvironment, requeue, requeue_from_env, requeue_signal_from_env
from fabriclite.supervision.rank.child import ERROR_FILE_ENV, SUPERVISOR_PID_ENV, stop_marker

#: the signals recorded by default (the requeue signal may be another: ``requeue_settings``)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_received: Optional[int] = None
_installed = False
_requeue_signal: signal.Signals = signal.SIGUSR1
_auto_requeue = True
_recorded: Tuple[int, ...] = ()


def received() -> Optional[int]:
    """The first preemption signal this process recorded (SIGTERM / the requeue signal), or None."""
    return _received


def requeue_settings(environment: Any = None) -> Tuple[signal.Signals, bool]:
    """(requeue signal, auto requeue) for a rank: a ``SLURMEnvironment``'s own ``requeue_signal`` /
    ``auto_requeue`` (with ``$FABRICLITE_REQUEUE=0`` also switching requeueing off), else
    ``$FABRICLITE_REQUEUE_SIGNAL`` / ``$FABRICLITE_REQUEUE`` (what ``fabriclite run`` passes its ranks)."""
    if isinstance(environment, SLURMEnvironment):
        return environment.requeue_signal, environment.auto_requeue and requeue_from_env()
    return requeue_signal_from_env(), requeue_from_env()


def install(global_rank: int, environment: Any = None) -> None:
    """Record SIGTERM and the requeue signal (``requeue_settings(environment)``) in this rank from now on (see
    the module docstring). Signals the program already handles are left to it; for the requeue signal global
    rank 0 says so once. Main thread only; idempotent."""
    global _installed, _requeue_signal, _auto_requeue, _recorded
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _requeue_signal, _auto_requeue = requeue_settings(environment)
    _installed = True
    marker = stop_marker(os.environ[ERROR_FILE_ENV]) if os.environ.get(SUPERVISOR_PID_ENV) and \
        os.environ.get(ERROR_FILE_ENV) else None
    torchrun = bool(os.environ.get("TORCHELASTIC_RUN_ID"))  # its agent stops workers with SIGTERM: leave it
    recorded = []
    for sig in dict.fromkeys((signal.SIGTERM, _requeue_signal)):
        if torchrun and sig == signal.SIGTERM:
            continue
        current = signal.getsignal(sig)
        if current is signal.SIG_DFL:
            signal.signal(sig, lambda signum, frame: _on_signal(signum, marker, in_handler=True))
            recorded.append(int(sig))
        elif sig == _requeue_signal and global_rank == 0:
            print(f"fabriclite: this program already handles {sig.name} ({_describe(current)}); fabriclite leaves "
                  f"it alone: it does not record {sig.name} for fabric.check_preempted() and does not requeue the "
                  "job after it (the program's handler does that, as submitit's does).", file=sys.stderr,
                  flush=True)
    _recorded = tuple(recorded)
    if marker is not None:
        _watch_wakeups(marker)
    elif global_rank == 0 and os.environ.get("SLURM_JOB_ID"):
        atexit.register(_requeue_at_exit)


def _describe(handler: Any) -> str:
    if handler is signal.SIG_IGN:
        return "it ignores it"
    module = getattr(handler, "__module__", None) or "?"
    return f"handler {module}.{getattr(handler, '__qualname__', repr(handler))}"


def _on_signal(signum: int, marker: Optional[str], in_handler: bool) -> None:
    global _received
    if signum == signal.SIGTERM and marker is not None and os.path.exists(marker):
        os._exit(128 + signal.SIGTERM)  # the supervisor stops this rank: end as SIGTERM's default would
    if _received is None and signum in _recorded:
        _received = signum


def _watch_wakeups(marker: str) -> None:
    """Let a thread see signals while the main thread may be blocked in C code (Python runs handlers only
    between bytecodes of the main thread). Skipped if the program uses the wakeup fd itself (asyncio)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        previous = -2
    if previous != -1:
        if previous >= 0:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            for signum in data:
                _on_signal(signum, marker, in_handler=False)

    threading.Thread(target=watch, name="fabriclite-signal-watch", daemon=True).start()


def _requeue_at_exit() -> None:
    if _received is not None and _received == _requeue_signal and _auto_requeue:
        requeue(print_to=None)


def check(strategy: Any) -> bool:
    """Whether any rank recorded a preemption signal: one all_reduce (max) of one number over the job; every
    rank gets the same answer at the same call (a collective: call it on every rank)."""
    flag = 1.0 if _received is not None else 0.0
    if strategy.world_size == 1:
        return bool(flag)
    tensor = torch.tensor([flag], device=strategy.root_device)
    return bool(strategy.flat_all_reduce(tensor, "max", None)[0].item() > 0)
