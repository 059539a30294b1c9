"""A warm spare: a rank's interpreter started ahead of need, with torch, fabriclite and the strategy's engine
already imported, that becomes the replacement when a rank fails.

A restarted rank's time to its first step is nearly all imports: torch, fabriclite, and ``torch._dynamo``, which
DDP's constructor imports (about 2 s of imports and 1.8 s of ``setup()`` on a 2-core machine; torchft's on top under
``--fault-tolerant``). So a supervisor that may restart its ranks keeps one spare per local rank
(``FABRICLITE_WARM_SPARES=0`` / ``fabriclite run --no-warm-spares``: none):

- ``--max-restarts N`` (a stop-the-world restart replaces every rank): the spares are started once the round's
  ranks here have all finished their first optimizer step (the supervisor's ``when_up``; started beside round 0
  they would slow its start on a small machine), and they import in a thread at the lowest priority (nice 19; the
  thread that later runs the script keeps the normal priority). After a restart, new spares are started once the
  new round is up again.
- ``--fault-tolerant`` (one rank per node, replaced while the others train): a fresh spare is started with every
  rank, so that one is ready by the next failure.

When a new round starts, each of its ranks is a spare that receives its environment and argv (one JSON line on its
stdin) and runs the job as ``python [flags] script.py args`` / ``python [flags] -m module args`` would
(``__main__``, ``sys.argv``, ``sys.path[0]``; interpreter flags are the spare's own). A spare that died meanwhile is
replaced by a cold start. A spare dies with its supervisor (PR_SET_PDEATHSIG), and an unused one ends when its stdin
closes (``close``: the supervisor's end). ``python -c CODE`` and ``python -`` jobs get no spares.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import Dict, List, NamedTuple, Optional, Sequence

from fabriclite.supervision.agent.output_forwarding import OutputOptions
from fabriclite.supervision.rank.child import die_with_parent, load_prctl
from fabriclite.supervision.processes.stopping import kill_group, reap

#: what a spare imports while it waits (``fabriclite run --fault-tolerant``'s rank)
LIVE_PRELOAD = ("torch", "fabriclite.fabric", "fabriclite.strategies.torchft.replica_parts")
#: what a spare imports while it waits under ``--max-restarts``: torch, fabriclite with the strategies a ddp / fsdp
#: job uses, and torch._dynamo (DDP's constructor imports it: most of a cold rank's ``setup()``)
RESTART_PRELOAD = ("torch", "torch._dynamo", "fabriclite.fabric", "fabriclite.strategies.ddp",
                   "fabriclite.strategies.fsdp")
#: ``FABRICLITE_WARM_SPARES=0`` turns spares off (each is an idle interpreter holding torch)
SPARES_ENV = "FABRICLITE_WARM_SPARES"
#: the nice value of a deferred spare's import thread (the lowest priority)
IMPORT_NICE = 19
#: interpreter options that take a value as the next argument
_FLAGS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")
#: a waiting spare's process name (/proc/PID/comm, what ps shows) once its imports are done (Linux)
READY_NAME = "warm-spare"  # at most 15 characters
_CODE = r"""
import json, os, runpy, sys, threading
nice, names = int(sys.argv[1]), sys.argv[3:]  # sys.argv[2]: the job's script or module (for ps)
READY = "%s"
del sys.argv[1:]


def load():
    if nice:
        try:  # this thread only: the main thread, which will run the script, keeps its priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass
    for name in names:
        try:
            __import__(name)
        except Exception:
            pass  # the script meets the same error itself, with its own traceback
    set_name(READY)


def set_name(name):  # the main thread's name, which ps shows as the process's
    try:
        with open(f"/proc/self/task/{os.getpid()}/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


try:
    with open("/proc/self/comm") as f:
        own_name = f.read().strip()
except OSError:
    own_name = "python"


loader = threading.Thread(target=load, name="fabriclite-spare-imports", daemon=True)
loader.start()
line = sys.stdin.readline()
if not line:
    raise SystemExit(0)  # never needed: the supervisor closed our stdin
if nice and loader.is_alive():
    try:  # needed before its imports are done: back to normal priority where allowed
        os.setpriority(os.PRIO_PROCESS, loader.native_id, 0)
    except OSError:
        pass
loader.join()
set_name(own_name)
job = json.loads(line)
os.environ.update(job["env"])
from fabriclite.supervision.rank.child import install_stack_handler
install_stack_handler()  # the supervisor's stack handler (the sitecustomize bootstrap ran before the env came)
sys.stdin.close()
sys.stdin = open(os.devnull)
if job["module"]:
    sys.argv = [job["module"], *job["argv"]]
    sys.path[0] = os.getcwd()
    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
else:
    sys.argv = [job["script"], *job["argv"]]
    sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))
    runpy.run_path(job["script"], run_name="__main__")
""" % READY_NAME


class Job(NamedTuple):
    """A rank's command taken apart: the interpreter with its flags, then a script file or a module, and its args."""

    interpreter: List[str]
    script: Optional[str]
    module: Optional[str]
    args: List[str]


def parse_command(command: Sequence[str]) -> Optional[Job]:
    """``python [flags] SCRIPT ARGS`` or ``python [flags] -m MODULE ARGS`` taken apart; None for what a spare cannot
    run (``-c CODE``, ``-`` / no script: stdin, a script that is not a file)."""
    if len(command) < 2:
        return None
    interpreter, i = [command[0]], 1
    while i < len(command):
        arg = command[i]
        if arg == "-m" and i + 1 < len(command):
            return Job(interpreter, None, command[i + 1], list(command[i + 2:]))
        if arg in _FLAGS_WITH_VALUE and i + 1 < len(command):
            interpreter += [arg, command[i + 1]]
            i += 2
        elif arg.startswith("-") and arg != "-" and not arg.startswith("-c") and not arg.startswith("-m"):
            interpreter.append(arg)
            i += 1
        else:
            break
    if i >= len(command) or command[i].startswith("-") or not os.path.isfile(command[i]):
        return None
    return Job(interpreter, command[i], None, list(command[i + 1:]))


class SpareWorker:
    """One waiting interpreter (its own process group, dying with this process). ``become`` makes it a rank."""

    def __init__(self, command: Sequence[str], output: OutputOptions, preload: Sequence[str],
                 nice: int = 0) -> None:
        job = parse_command(command)
        if job is None:
            raise ValueError(f"a warm spare cannot run {list(command)!r}: expected python [flags] SCRIPT ARGS or "
                             "python [flags] -m MODULE ARGS.")
        self.job = job
        parent = os.getpid()
        load_prctl()
        self.process = subprocess.Popen(
            [*job.interpreter, "-c", _CODE, str(nice), job.script or f"-m {job.module}", *preload],
            stdin=subprocess.PIPE, env={**os.environ, **output.child_env()}, start_new_session=True,
            preexec_fn=lambda: die_with_parent(parent), **output.popen_kwargs())
        self.pid = self.process.pid

    def become(self, env: Dict[str, str], output: OutputOptions, global_rank: int) -> "SpareWorker":
        """Run the job as rank ``global_rank`` with ``env`` added to the environment; returns self."""
        output.attach(global_rank, self.process)
        assert self.process.stdin is not None
        job = {"env": env, "script": self.job.script, "module": self.job.module, "argv": self.job.args}
        self.process.stdin.write(json.dumps(job).encode() + b"\n")
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
    """One spare per local rank, for the next round (see the module docstring). ``deferred``: spares are started by
    ``top_up`` (once the round is up), at low priority; else one is started with every rank."""

    def __init__(self, command: Sequence[str], output: OutputOptions, preload: Sequence[str] = LIVE_PRELOAD,
                 local_ranks: int = 1, deferred: bool = False) -> None:
        self.command, self.output, self.preload = list(command), output, tuple(preload)
        self.local_ranks, self.deferred = local_ranks, deferred
        self._waiting: Dict[int, SpareWorker] = {}

    @classmethod
    def for_job(cls, command: Sequence[str], output: OutputOptions, max_restarts: int, live: bool = True,
                local_ranks: int = 1) -> Optional["Spares"]:
        """Spares for a job that may restart (``max_restarts`` > 0) and runs ``python [flags] SCRIPT ARGS`` or
        ``python [flags] -m MODULE ARGS`` (see :func:`parse_command`); None otherwise, or with
        ``$FABRICLITE_WARM_SPARES=0``. ``live``: ``--fault-tolerant``'s (torchft preloaded, started with each rank);
        else ``--max-restarts``' (deferred to ``top_up``)."""
        if not max_restarts or parse_command(command) is None or os.environ.get(SPARES_ENV, "1") == "0":
            return None
        if live:
            return cls(command, output)
        return cls(command, output, RESTART_PRELOAD, local_ranks, deferred=True)

    def start(self, local_rank: int, env: Dict[str, str], global_rank: int, restart: bool) -> Optional[SpareWorker]:
        """The rank as a spare that was waiting (a restart, with one alive), else None (start it the usual way);
        not deferred: a fresh spare is started for ``local_rank``'s next restart too."""
        spare = self._waiting.pop(local_rank, None) if restart else None
        if spare is not None and spare.poll() is not None:  # it died while waiting
            spare = None
        if not self.deferred and local_rank not in self._waiting:
            self._waiting[local_rank] = SpareWorker(self.command, self.output, self.preload)
        return spare.become(env, self.output, global_rank) if spare is not None else None

    def top_up(self) -> None:
        """Start a spare, at low priority, for every local rank that has none waiting (a dead one is replaced)."""
        for local_rank in range(self.local_ranks):
            spare = self._waiting.get(local_rank)
            if spare is not None and spare.poll() is not None:
                spare.discard()
                spare = None
            if spare is None:
                self._waiting[local_rank] = SpareWorker(self.command, self.output, self.preload, IMPORT_NICE)

    @property
    def pids(self) -> List[int]:
        return [spare.pid for spare in self._waiting.values()]

    def close(self) -> None:
        """End every unused spare."""
        for spare in self._waiting.values():
            spare.discard()
        self._waiting.clear()
