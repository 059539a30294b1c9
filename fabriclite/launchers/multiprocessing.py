"""spawn / fork launchers (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``): run a function in child
processes under the same supervision as script mode; the caller gets rank 0's return value."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
from datetime import timedelta
from multiprocessing.reduction import DupFd
from typing import Any, Callable, Dict, List, Optional, Tuple

from fabriclite.launchers.base import Launcher
from fabriclite.supervision.rank.child import watch_supervisor, write_error_file
from fabriclite.supervision.agent.output_forwarding import OutputOptions, redirect_output
from fabriclite.supervision.agent.preemption import EXIT_PREEMPTED, PreemptOptions
from fabriclite.supervision.processes.stopping import print_summary
from fabriclite.supervision.agent.node_layout import NodeLayout
from fabriclite.supervision.agent.supervisor import JobFailed, Supervisor


class ProcessWorker:
    """A rank started with multiprocessing (it makes its own process group first thing)."""

    def __init__(self, process: "mp.process.BaseProcess") -> None:
        self.process = process
        self.pid = process.pid

    def poll(self) -> Optional[int]:
        """None while running, else the exit code (negative: killed by that signal)."""
        return None if self.process.is_alive() else self.process.exitcode


class MultiprocessingLauncher(Launcher):
    """Starts ``num_processes`` children with ``start_method`` ("spawn", "fork", "forkserver").

    ``launch(fn, *args)`` returns what global rank 0's ``fn`` returned (it must pickle); if any rank
    fails, every rank is stopped and :class:`JobFailed` is raised with the supervisor's summary.
    SIGINT / SIGTERM to this process stop every rank, then raise KeyboardInterrupt / SystemExit(143).
    ``output`` (default: $FABRICLITE_RANK_PREFIX / $FABRICLITE_LOG_DIR) prefixes and logs ranks' output.
    Rendezvous problems (port in use, ...) raise fabriclite.distributed.rendezvous.RendezvousError.
    """

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int, timeout: timedelta,
                 start_method: str = "spawn", output: Optional[OutputOptions] = None) -> None:
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.timeout = timeout
        self.start_method = start_method
        self.output = output

    @property
    def is_interactive_compatible(self) -> bool:  # type: ignore[override]
        return self.start_method == "fork"

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        env = self.cluster_environment
        layout = NodeLayout(self.num_nodes, env.node_rank(), self.num_processes)
        context = mp.get_context(self.start_method)
        with tempfile.TemporaryDirectory(prefix="fabriclite-result-") as tmp:
            result_path = os.path.join(tmp, "result.pkl")
            output = self.output or OutputOptions.from_env()
            supervisor = Supervisor(layout, env.main_address, env.main_port, self.timeout, output, report=False,
                                    preempt=PreemptOptions.from_env())
            sys.stdout.flush()
            sys.stderr.flush()

            def start(local_rank: int, child_env: Dict[str, str]) -> ProcessWorker:
                rank = layout.global_rank(local_rank)
                pipes = output.open_pipes()
                fds = None if pipes is None else (self._pass_fd(pipes[0][1]), self._pass_fd(pipes[1][1]))
                process = context.Process(
                    target=_entry, args=({**output.child_env(), **child_env}, os.getpid(), result_path, fds,
                                         self._inherited(supervisor), function, args, kwargs),
                    name=f"fabriclite-rank-{rank}",
                )
                try:
                    process.start()
                finally:
                    if pipes is not None:
                        os.close(pipes[0][1])
                        os.close(pipes[1][1])
                if pipes is not None:
                    output.attach_fds(rank, pipes[0][0], pipes[1][0])
                return ProcessWorker(process)

            code = supervisor.run(start)
            stopped_by = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, supervisor.preemption.options.requeue_signal)
            if code in (*(128 + int(sig) for sig in stopped_by), EXIT_PREEMPTED):
                print_summary(supervisor.summary)
                if code == 128 + signal.SIGINT:
                    raise KeyboardInterrupt(supervisor.summary)
                raise SystemExit(code)
            if code != 0:
                raise JobFailed(supervisor.summary, code)
            if not os.path.exists(result_path):
                return None
            with open(result_path, "rb") as f:
                return pickle.load(f)


    def _inherited(self, supervisor: Supervisor) -> List[int]:
        """The supervisor's file descriptors a forked rank inherits and must close."""
        return supervisor.private_fds if self.start_method == "fork" else []

    def _pass_fd(self, fd: int) -> Any:
        """``fd`` in a form the child can use: inherited as is by fork, duplicated for spawn."""
        return fd if self.start_method == "fork" else DupFd(fd)


def _entry(child_env: Dict[str, str], parent_pid: int, result_path: str, fds: Optional[Tuple[Any, Any]],
           inherited: List[int], function: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    # a forked rank inherits the supervisor's handlers, which only take note of a signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setpgid(0, 0)
    watch_supervisor(parent_pid)
    for fd in inherited:
        os.close(fd)
    if fds is not None:
        redirect_output(*(fd if isinstance(fd, int) else fd.detach() for fd in fds))
    os.environ.update(child_env)
    try:
        result = function(*args, **kwargs)
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            write_error_file(child_env["FABRICLITE_ERROR_FILE"], exc)
        raise
    if child_env["FABRICLITE_RANK"] == "0":
        tmp = f"{result_path}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(_to_cpu(result), f)
        os.replace(tmp, result_path)


def _to_cpu(result: Any) -> Any:
    import torch
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(result, torch.Tensor, lambda t: t.detach().cpu())
