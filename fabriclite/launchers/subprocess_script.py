"""Script mode (torchrun-style): the launching process becomes a small supervisor that re-runs the
script once per local rank and exits with the job's exit code.

Code above ``fabric.launch()`` therefore runs once in the supervisor too, and once in every rank.
"""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence

from fabriclite.launchers.base import Launcher
from fabriclite.launchers.warm_spare import Spares
from fabriclite.distributed.rendezvous import RendezvousError
from fabriclite.supervision.rank.child import die_with_parent, load_prctl
from fabriclite.supervision.lighthouse import LiveOptions
from fabriclite.supervision.agent.output_forwarding import OutputOptions
from fabriclite.supervision.agent.preemption import PreemptOptions
from fabriclite.supervision.agent.restarts import RestartPolicy
from fabriclite.supervision.processes.stopping import exit_process, print_summary
from fabriclite.supervision.agent.node_layout import NodeLayout
from fabriclite.supervision.agent.supervisor import Supervisor


class PopenWorker:
    """A rank in its own process (and process group); dies with its supervisor."""

    def __init__(self, command: Sequence[str], env: Dict[str, str], output: OutputOptions, global_rank: int) -> None:
        parent = os.getpid()
        load_prctl()
        self.process = subprocess.Popen(
            list(command), env={**os.environ, **output.child_env(), **env}, start_new_session=True,
            preexec_fn=lambda: die_with_parent(parent), **output.popen_kwargs(),
        )
        output.attach(global_rank, self.process)
        self.pid = self.process.pid

    def poll(self) -> Optional[int]:
        """None while running, else the exit code (negative: killed by that signal)."""
        return self.process.poll()


def script_command() -> List[str]:
    """The command that started this Python process (interpreter flags, ``-m``, ``-c`` kept)."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    return [sys.executable, *argv[1:]]


def run_supervised(command: Sequence[str], layout: NodeLayout, main_address: str, main_port: int,
                   timeout: timedelta, output: Optional[OutputOptions] = None,
                   extra_env: Optional[Dict[str, str]] = None, restarts: Optional[RestartPolicy] = None,
                   preempt: Optional[PreemptOptions] = None, live: Optional[LiveOptions] = None) -> int:
    """Start ``command`` once per local rank under a Supervisor (each rank's environment gets
    ``extra_env`` too; ``restarts`` / ``preempt`` / ``live``: see supervision.agent.restarts / .preemption / .lighthouse,
    default from the environment / none); its summary goes to stderr; return the exit
    code (1 with a clear message on stderr when the rendezvous store or the lighthouse cannot be hosted or
    joined)."""
    supervisor = Supervisor(layout, main_address, main_port, timeout, output, extra_env=extra_env,
                            restarts=restarts, preempt=preempt or PreemptOptions.from_env(), live=live)
    # a restarted rank is a warm spare, its imports done (launchers/warm_spare.py): --max-restarts' are started once a
    # round's ranks are up (when_up), --fault-tolerant's with each rank
    spares = Spares.for_job(command, supervisor.output, supervisor.restarts.max_restarts, live=live is not None,
                            local_ranks=layout.local_world_size)

    def start(local_rank: int, env: Dict[str, str]) -> Any:
        rank = layout.global_rank(local_rank)
        spare = spares.start(local_rank, env, rank, restart=supervisor.round > 0) if spares is not None else None
        return spare or PopenWorker(command, env, supervisor.output, rank)

    try:
        return supervisor.run(start, when_up=spares.top_up if spares is not None and spares.deferred else None)
    except RendezvousError as err:
        print_summary(str(err))
        return 1
    finally:
        if spares is not None:
            spares.close()


class SubprocessScriptLauncher(Launcher):
    """Re-runs the current script for every local rank; the calling process only supervises."""

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int, timeout: timedelta) -> None:
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.timeout = timeout
        #: restarts after a failure (Fabric(max_restarts=N) / $FABRICLITE_MAX_RESTARTS; set by Fabric.launch)
        self.max_restarts = 0

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> NoReturn:
        env = self.cluster_environment
        layout = NodeLayout(self.num_nodes, env.node_rank(), self.num_processes)
        sys.stdout.flush()
        sys.stderr.flush()
        code = run_supervised(script_command(), layout, env.main_address, env.main_port, self.timeout,
                              restarts=RestartPolicy.from_env(self.max_restarts))
        exit_process(code)
