"""SLURMEnvironment: ranks started by ``srun``."""

import os
import re
import signal
import subprocess
import sys
from typing import Any, List, Optional, Union

from fabriclite.environments._vars import (first_set, main_address_or, main_port_or, parse_int, read_int,
                                           read_optional_int)
from fabriclite.environments.base import ClusterEnvironment
from fabriclite.environments.hostlist import first_host

#: Job names of an interactive SLURM shell (``srun --pty bash``, ``salloc``): its variables describe the shell.
INTERACTIVE_JOB_NAMES = ("bash", "interactive")

#: Where the node list is read from, most specific first (the step's nodes, then the job's).
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
#: Where the number of tasks on each node is read from, most specific first.
_TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
#: Where the number of nodes is read from, most specific first.
_NUM_NODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")

_TASKS_ENTRY = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(text: str) -> List[int]:
    """SLURM's tasks-per-node notation, one entry per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: List[int] = []
    for entry in text.split(","):
        match = _TASKS_ENTRY.match(entry.strip())
        if not match:
            raise ValueError(
                f"SLURM tasks-per-node value {text!r}: {entry!r} is not of the form N or N(xM)."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


#: ``fabriclite run --requeue-signal`` / this variable: the signal that means "save, exit, requeue" (default USR1)
REQUEUE_SIGNAL_ENV = "FABRICLITE_REQUEUE_SIGNAL"
#: ``fabriclite run --no-requeue`` / ``FABRICLITE_REQUEUE=0``: save and exit after it, but do not requeue
REQUEUE_ENV = "FABRICLITE_REQUEUE"
DEFAULT_REQUEUE_SIGNAL = signal.SIGUSR1
#: signals a process cannot handle, or that fabriclite's supervisor uses for itself
_UNUSABLE = ("SIGKILL", "SIGSTOP", "SIGINT", "SIGCHLD", "SIGPIPE")


def parse_signal(value: Any, where: str) -> signal.Signals:
    """A requeue signal from ``"USR2"``, ``"SIGUSR2"``, ``12`` or ``signal.SIGUSR2``; ValueError naming ``where``,
    the value and the fix otherwise (also for a signal that cannot be handled, such as SIGKILL)."""
    sig: Optional[signal.Signals] = None
    if isinstance(value, signal.Signals):
        sig = value
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            sig = signal.Signals(value)
        except ValueError:
            sig = None
    elif isinstance(value, str):
        text = value.strip().upper()
        if text.isdigit():
            return parse_signal(int(text), where)
        name = text if text.startswith("SIG") else f"SIG{text}"
        sig = getattr(signal.Signals, name, None) if name.isidentifier() else None
    if sig is None or sig.name in _UNUSABLE:
        why = f"{sig.name} cannot be used" if sig is not None else "not a signal"
        raise ValueError(f"{where}={value!r}: {why}; expected the signal SLURM sends before it stops the job, such "
                         "as USR1 (the default, sbatch --signal=USR1@90) or USR2.")
    return sig


def requeue_signal_from_env() -> signal.Signals:
    """``$FABRICLITE_REQUEUE_SIGNAL`` (``--requeue-signal``), else SIGUSR1; ValueError for a bad value."""
    raw = os.environ.get(REQUEUE_SIGNAL_ENV, "").strip()
    return parse_signal(raw, f"${REQUEUE_SIGNAL_ENV}") if raw else DEFAULT_REQUEUE_SIGNAL


def requeue_from_env() -> bool:
    """False when ``$FABRICLITE_REQUEUE`` is ``0`` (``--no-requeue``)."""
    return os.environ.get(REQUEUE_ENV, "1").strip() != "0"


#: Lightning's address and port when neither MASTER_* nor SLURM's node list / job id are set
DEFAULT_ADDRESS, DEFAULT_PORT = "127.0.0.1", 12910


def slurm_job() -> Optional[str]:
    """The SLURM job to requeue: ``$SLURM_ARRAY_JOB_ID_$SLURM_ARRAY_TASK_ID`` for an array job, else
    ``$SLURM_JOB_ID``; None outside SLURM."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def requeue(print_to: Any = sys.stderr) -> bool:
    """Run ``scontrol requeue <job>`` (see slurm_job); whether it succeeded. Says what it does on ``print_to``
    (stderr by default) before it runs it: SLURM ends every process of the job as it requeues it, this one and
    scontrol included, so a line printed after could be lost. A scontrol ended by SIGTERM / SIGKILL is taken as
    that (requeued); a failure is said with scontrol's message."""
    job = slurm_job()
    if job is None:
        return False
    out = print_to or sys.stderr
    print(f"fabriclite: requeueing SLURM job {job} (scontrol requeue {job}).", file=out, flush=True)
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        ok = done.returncode == 0 or -done.returncode in (signal.SIGTERM, signal.SIGKILL)
        detail = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
    except (OSError, subprocess.TimeoutExpired) as err:
        ok, detail = False, str(err)
    if not ok:
        print(f"fabriclite: could not requeue SLURM job {job}: scontrol requeue {job} failed: {detail}", file=out,
              flush=True)
    return ok


def _first_node() -> str:
    """The first host of the step's (else the job's) node list; 127.0.0.1 without one (Lightning's default)."""
    var = first_set(_NODELIST_VARS)
    return DEFAULT_ADDRESS if var is None else first_host(os.environ[var])


def _job_port() -> int:
    """``15000 + int(last 4 digits of SLURM_JOB_ID)``, else 12910, as Lightning derives it."""
    job_id = os.environ.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return DEFAULT_PORT
    return 15000 + parse_int("SLURM_JOB_ID", job_id[-4:], SLURMEnvironment.name)


class SLURMEnvironment(ClusterEnvironment):
    """Ranks started by ``srun`` (one process per SLURM task).

    Detected when ``SLURM_NTASKS`` is set and ``SLURM_JOB_NAME`` is not "bash" or "interactive" (an interactive
    shell's variables describe the shell, not the ranks: force this environment there if you start ranks with srun).

    Reads ``SLURM_NTASKS`` (world), ``SLURM_PROCID`` (rank), ``SLURM_LOCALID`` (local rank), ``SLURM_NODEID`` (node
    rank); ranks on this node from ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_NTASKS_PER_NODE`` /
    ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"`` notation); nodes from ``SLURM_STEP_NUM_NODES`` / ``SLURM_NNODES``.
    Main address: ``MASTER_ADDR``, else the first host of ``SLURM_STEP_NODELIST`` / ``SLURM_NODELIST`` /
    ``SLURM_JOB_NODELIST``, else 127.0.0.1. Main port: ``MASTER_PORT``, else ``15000 + int(last 4 digits of
    SLURM_JOB_ID)``, else 12910 (as Lightning does), so every rank of a job agrees without talking and concurrent
    jobs rarely collide.
    """

    name = "slurm"

    def __init__(self, auto_requeue: bool = True,
                 requeue_signal: Optional[Union[signal.Signals, int, str]] = None) -> None:
        """Lightning's arguments, acted on by ``fabric.launch()`` in ranks that ``srun`` started:
        ``requeue_signal`` (default ``$FABRICLITE_REQUEUE_SIGNAL``, else SIGUSR1) is recorded instead of ending
        the rank (``fabric.check_preempted()`` turns True on every rank), and after it, with ``auto_requeue``
        (and ``$FABRICLITE_REQUEUE`` not ``0``), global rank 0 runs ``scontrol requeue`` at exit. A program that
        handles the signal itself (submitit) keeps its handler. Under ``fabriclite run`` the supervisor's flags
        say the same (``--requeue-signal``, ``--no-requeue``). ValueError for a value that is not a usable
        signal, or an ``auto_requeue`` that is not a bool."""
        if not isinstance(auto_requeue, bool):
            raise ValueError(f"SLURMEnvironment(auto_requeue={auto_requeue!r}): expected True or False.")
        self.auto_requeue = auto_requeue
        self.requeue_signal = (requeue_signal_from_env() if requeue_signal is None else
                               parse_signal(requeue_signal, "SLURMEnvironment(requeue_signal)"))

    @classmethod
    def detect(cls) -> bool:
        return cls.not_detected_reason() is None

    @classmethod
    def not_detected_reason(cls) -> Optional[str]:
        """Why :meth:`detect` is False (a sentence for the user), or None when it is True."""
        if not os.environ.get("SLURM_NTASKS", "").strip():
            return "SLURM_NTASKS is not set, so this process was not started by srun."
        job_name = os.environ.get("SLURM_JOB_NAME", "").strip()
        if job_name in INTERACTIVE_JOB_NAMES:
            return (
                f"SLURM_JOB_NAME={job_name!r} marks an interactive SLURM shell, whose variables describe the shell, "
                f"not your ranks. If you start the ranks with srun from it, force the environment with "
                f"plugins=[SLURMEnvironment()] or FABRICLITE_CLUSTER_ENVIRONMENT=slurm."
            )
        return None

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return main_address_or(_first_node)

    @property
    def main_port(self) -> int:
        return main_port_or(self.name, _job_port)

    def world_size(self) -> int:
        return read_int("SLURM_NTASKS", self.name, minimum=1)

    def global_rank(self) -> int:
        return read_int("SLURM_PROCID", self.name)

    def local_rank(self) -> int:
        return read_int("SLURM_LOCALID", self.name)

    def node_rank(self) -> int:
        return read_int("SLURM_NODEID", self.name)

    def local_world_size(self) -> Optional[int]:
        var = first_set(_TASKS_PER_NODE_VARS)
        if var is None:
            return None
        counts = parse_tasks_per_node(os.environ[var])
        if len(counts) == 1:
            return counts[0]
        node = self.node_rank()
        if node >= len(counts):
            raise ValueError(
                f"The slurm cluster environment read {var}={os.environ[var]!r} ({len(counts)} nodes), "
                f"but SLURM_NODEID={node}."
            )
        return counts[node]

    def num_nodes(self) -> Optional[int]:
        var = first_set(_NUM_NODES_VARS)
        return None if var is None else read_optional_int(var, self.name, minimum=1)

    @staticmethod
    def job_name() -> Optional[str]:
        """``SLURM_JOB_NAME``, or None."""
        return os.environ.get("SLURM_JOB_NAME")

    @staticmethod
    def job_id() -> Optional[int]:
        """``SLURM_JOB_ID`` as an int; None when unset, not a number, or in an interactive shell (Lightning's rule)."""
        if os.environ.get("SLURM_JOB_NAME", "").strip() in INTERACTIVE_JOB_NAMES:
            return None
        raw = os.environ.get("SLURM_JOB_ID", "").strip()
        return int(raw) if raw.isdigit() else None

    @staticmethod
    def resolve_root_node_address(nodes: str) -> str:
        """The first host of a SLURM hostlist expression (Lightning's name for :func:`first_host`)."""
        return first_host(nodes)
