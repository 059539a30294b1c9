"""spawn / fork launchers (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``): run a function in child
processes under the same supervision as script mode; the caller gets rank 0's return value."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import tempfile
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Tuple

from fabriclite.launchers.base import Launcher
from fabriclite.launchers.child import die_with_parent, write_error_file
from fabriclite.launchers.output import OutputOptions
from fabriclite.launchers.supervisor import JobFailed, Layout, Supervisor


class ProcessWorker:
    def __init__(self, process: "mp.process.BaseProcess") -> None:
        self.process = process
        self.pid = process.pid

    def poll(self) -> Optional[int]:
        return None if self.process.is_alive() else self.process.exitcode


class MultiprocessingLauncher(Launcher):
    """Starts ``num_processes`` children with ``start_method`` ("spawn", "fork", "forkserver").

    ``launch(fn, *args)`` returns what global rank 0's ``fn`` returned (it must pickle); if any rank
    fails, every rank is stopped and :class:`JobFailed` is raised with the supervisor's summary.
    """

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int, timeout: timedelta,
                 start_method: str = "spawn") -> None:
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.timeout = timeout
        self.start_method = start_method

    @property
    def is_interactive_compatible(self) -> bool:  # type: ignore[override]
        return self.start_method == "fork"

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        env = self.cluster_environment
        layout = Layout(self.num_nodes, env.node_rank(), self.num_processes)
        context = mp.get_context(self.start_method)
        with tempfile.TemporaryDirectory(prefix="fabriclite-result-") as tmp:
            result_path = os.path.join(tmp, "result.pkl")
            supervisor = Supervisor(layout, env.main_address, env.main_port, self.timeout, OutputOptions())
            sys.stdout.flush()
            sys.stderr.flush()

            def start(local_rank: int, child_env: Dict[str, str]) -> ProcessWorker:
                process = context.Process(
                    target=_entry, args=(child_env, os.getpid(), result_path, function, args, kwargs),
                    name=f"fabriclite-rank-{layout.global_rank(local_rank)}",
                )
                process.start()
                return ProcessWorker(process)

            code = supervisor.run(start)
            if code != 0:
                raise JobFailed(supervisor.summary, code)
            if not os.path.exists(result_path):
                return None
            with open(result_path, "rb") as f:
                return pickle.load(f)


def _entry(child_env: Dict[str, str], parent_pid: int, result_path: str, function: Callable[..., Any],
           args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    os.setpgid(0, 0)
    die_with_parent(parent_pid)
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
