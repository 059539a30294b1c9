"""Launchers: how one node's processes start (script re-run, spawn/fork, xla), all supervised.

``base`` (the seam), ``subprocess_script`` (script mode: the launching process becomes the supervisor and
re-runs the script per rank), ``multiprocessing`` (spawn / fork), ``xla`` (torch_xla's spawn). Watching the ranks
once started is ``supervision``'s job.

May import: ``supervision``, ``accelerators``, ``environments``, ``precision``, ``distributed``. Entry points:
``launcher_for``, ``SubprocessScriptLauncher``, ``MultiprocessingLauncher``.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from fabriclite.launchers.base import Launcher
from fabriclite.launchers.multiprocessing import MultiprocessingLauncher
from fabriclite.launchers.subprocess_script import SubprocessScriptLauncher
from fabriclite.supervision.agent.supervisor import JobFailed


def launcher_for(start_method: str, cluster_environment: Any, num_processes: int, num_nodes: int,
                 timeout: timedelta) -> Launcher:
    """The launcher for a DDP ``start_method``: "popen" (script mode), "spawn", "fork", "forkserver"."""
    if start_method == "popen":
        return SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes, timeout)
    return MultiprocessingLauncher(cluster_environment, num_processes, num_nodes, timeout, start_method)


__all__ = ["JobFailed", "Launcher", "MultiprocessingLauncher", "SubprocessScriptLauncher", "launcher_for"]
