"""Launchers: how one node's processes start (script re-run, spawn/fork, xla), all supervised."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from fabriclite.launchers.base import Launcher
from fabriclite.launchers.multiprocessing import MultiprocessingLauncher
from fabriclite.launchers.subprocess_script import SubprocessScriptLauncher
from fabriclite.launchers.supervisor import JobFailed


def launcher_for(start_method: str, cluster_environment: Any, num_processes: int, num_nodes: int,
                 timeout: timedelta) -> Launcher:
    """The launcher for a DDP ``start_method``: "popen" (script mode), "spawn", "fork", "forkserver"."""
    if start_method == "popen":
        return SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes, timeout)
    return MultiprocessingLauncher(cluster_environment, num_processes, num_nodes, timeout, start_method)


__all__ = ["JobFailed", "Launcher", "MultiprocessingLauncher", "SubprocessScriptLauncher", "launcher_for"]
