"""A warm spare: a rank's interpreter started ahead of need, with torch, fabriclite and the strategy's engine
already imported, that becomes the replacement when a rank fails.

Under ``fabriclite run --fault-tolerant`` a restarted rank's time to its first step is nearly all imports (torch,
and torch._dynamo for torchft's DDP wrapper): about 2 s of the 2.0 s measured by hand. With ``--max-restarts`` the
supervisor keeps one spare per local rank (``FABRICLITE_WARM_SPARES=0``: none); when a new round starts, each rank
is a spare that receives its environment and argv (one JSON line on its stdin) and runs the script with ``runpy``, as ``python script.py args`` would (``__main__``,
``sys.argv``, the script's folder first on ``sys.path``). A fresh spare is started for the next failure. A spare
dies with its supervisor, and an unused one ends when its stdin closes.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import Dict, List, Optional, Sequence

from fabriclite.supervision.output_forwarding import OutputOptions
from fabriclite.supervision.rank_child import die_with_parent, load_prctl
from fabriclite.supervision.stopping import kill_group, reap

#: what a spare imports while it waits (``fabriclite run --fault-tolerant``'s rank)
LIVE_PRELOAD = ("torch", "fabriclite.fabric", "fabriclite.strategies.torchft_parts")
#: ``FABRICLITE_WARM_SPARES=0`` turns spares off (each is an idle interpreter holding torch and torchft)
SPARES_ENV = "FABRICLITE_WARM_SPARES"
_CODE = r"""
import json, os, runpy, sys
for name in sys.argv[1:]:
    __import__(name)
line = sys.stdin.readline()
if not line:
    raise SystemExit(0)  # never needed: the supervisor closed our stdin
job = json.loads(line)
os.environ.update(job["env"])
from fabriclite.supervision.rank_child import install_stack_handler
install_stack_handler()  # the supervisor's stack handler (the sitecustomize bootstrap ran before the env came)
sys.argv = job["argv"]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
sys.stdin.close()
sys.stdin = open(os.devnull)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class SpareWorker:
    """One waiting interpreter (its own process group, dying with this process). ``become`` makes it a rank."""

    def __init__(self, command: Sequence[str], output: OutputOptions, preload: Sequence[str]) -> None:
        parent = os.getpid()
        load_prctl()
        self.argv = list(command[1:])
        self.process = subprocess.Popen(
            [command[0], "-c", _CODE, *preload], stdin=subprocess.PIPE, env={**os.environ, **output.child_env()},
            start_new_session=True, preexec_fn=lambda: die_with_parent(parent), **output.popen_kwargs())
        self.pid = self.process.pid

    def become(self, env: Dict[str, str], output: OutputOptions, global_rank: int) -> "SpareWorker":
        """Run the script as rank ``global_rank`` with ``env`` added to the environment; returns self."""
        output.attach(global_rank, self.process)
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"env": env, "argv": self.argv}).encode() + b"\n")
        self.process.stdin.close()
        return self

    def poll(self) -> Optional[int]:
        """None while running, else the exit code (negative: killed by that signal)."""
        return self.process.poll()

    def discard(self) -> None:
        """End an unused spare."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        kill_group(self.pid, 9)
        reap(self)


class Spares:
    """One spare per local rank, for the next round (see the module docstring)."""

    def __init__(self, command: Sequence[str], output: OutputOptions, preload: Sequence[str] = LIVE_PRELOAD) -> None:
        self.command, self.output, self.preload = list(command), output, tuple(preload)
        self._waiting: Dict[int, SpareWorker] = {}

    @classmethod
    def for_job(cls, command: Sequence[str], output: OutputOptions, max_restarts: int) -> Optional["Spares"]:
        """Spares for a job that may restart (``max_restarts`` > 0) and runs ``python SCRIPT ARGS`` (not ``-m`` /
        ``-c`` / interpreter flags); None otherwise, or with ``$FABRICLITE_WARM_SPARES=0``."""
        runs_a_file = len(command) >= 2 and not command[1].startswith("-") and os.path.isfile(command[1])
        if not max_restarts or not runs_a_file or os.environ.get(SPARES_ENV, "1") == "0":
            return None
        return cls(command, output)

    def start(self, local_rank: int, env: Dict[str, str], global_rank: int, restart: bool) -> Optional[SpareWorker]:
        """The rank as a spare that was waiting (a restart, with one ready), else None (start it the usual way);
        either way a fresh spare is started for ``local_rank``'s next restart."""
        spare = self._waiting.pop(local_rank, None) if restart else None
        if spare is not None and spare.poll() is not None:  # it died while waiting
            spare = None
        if local_rank not in self._waiting:
            self._waiting[local_rank] = SpareWorker(self.command, self.output, self.preload)
        return spare.become(env, self.output, global_rank) if spare is not None else None

    @property
    def pids(self) -> List[int]:
        return [spare.pid for spare in self._waiting.values()]

    def close(self) -> None:
        """End every unused spare."""
        for spare in self._waiting.values():
            spare.discard()
        self._waiting.clear()
