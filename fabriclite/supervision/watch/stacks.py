"""Live stacks of a node's ranks: taken by the supervisor when the job is stopped because of a hang (and on demand,
SIGQUIT to the supervisor), every thread of every rank still alive, before any SIGTERM.

Two ways, the first that works per rank:

- ``py-spy dump`` (``pip install py-spy``; in fabriclite's ``test`` extra) where it is installed and ptrace is
  allowed: it reads the stack from outside, pausing the rank for a moment; it names threads, and works whatever
  the rank did with its signal handlers. Where ptrace is refused (a non-root user in a container without
  ``CAP_SYS_PTRACE``, or ``kernel.yama.ptrace_scope`` 2 / 3) it fails, and the handler is used instead.
- The handler: every rank started by a supervisor registers ``faulthandler`` on :data:`STACK_SIGNAL` in its
  bootstrap, before torch or the script is imported (``rank/bootstrap/sitecustomize.py``), writing to a per-rank
  file. faulthandler writes from C, so a rank blocked inside a collective still answers; it does not name
  threads. A rank whose handler is not installed yet (its interpreter still starting) is not signalled.

``$FABRICLITE_STACKS``: ``auto`` (default: py-spy, else the handler), ``py-spy``, ``handler`` (never py-spy) or
``off`` (no stacks).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from fabriclite.supervision.rank import progress as rank_progress
from fabriclite.supervision.rank.child import STACK_FILE_ENV, STACK_SIGNAL

STACKS_ENV = "FABRICLITE_STACKS"
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rank", "bootstrap")
#: how long one rank's dump may take (py-spy, or the handler's file to stop growing)
DUMP_TIMEOUT_S = 10.0
#: library frames shown per thread after the user's frames (the rest are counted)
LIBRARY_FRAMES_SHOWN = 4
NCCL_HINT = ("  on GPUs: set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 (and TORCH_NCCL_DUMP_ON_TIMEOUT=1) so that NCCL's "
             "flight recorder dumps the collectives each rank had queued when the timeout fires "
             "(docs/reliability.md, \"Hangs\").")


@dataclass(frozen=True)
class Frame:
    function: str
    filename: str
    line: int

    @property
    def is_user(self) -> bool:
        return is_user_file(self.filename)

    def __str__(self) -> str:
        return f'File "{self.filename}", line {self.line}, in {self.function}'


@dataclass
class Thread:
    name: str
    #: innermost first
    frames: List[Frame] = field(default_factory=list)


@dataclass
class RankStack:
    """One rank's dump: its threads, or why there is none (``missing``)."""

    global_rank: int
    pid: int
    method: str = ""
    threads: List[Thread] = field(default_factory=list)
    missing: str = ""


def package_root() -> str:
    """The fabriclite package's folder: this module's, up one folder for each package between them."""
    path = os.path.dirname(os.path.abspath(__file__))
    for _ in range(__name__.count(".") - 1):
        path = os.path.dirname(path)
    return path


def _library_roots() -> Tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get("stdlib", ""), paths.get("platstdlib", ""), paths.get("purelib", ""),
             paths.get("platlib", ""), sys.prefix, sys.base_prefix, sys.exec_prefix, package_root()}
    return tuple(sorted((os.path.abspath(r) + os.sep for r in roots if r), key=len, reverse=True))


_LIBRARY = _library_roots()


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not Python's, not an installed package's, not fabriclite's."""
    if not filename or filename.startswith("<") or "site-packages" in filename or "dist-packages" in filename:
        return False
    path = os.path.abspath(filename)
    return not any(path.startswith(root) for root in _LIBRARY)


# ---------------------------------------------------------------------- parsing
_PYSPY_THREAD = re.compile(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(([^)]*)\)(?:: "(.*)")?')
_PYSPY_FRAME = re.compile(r"^\s+(.+?) \((.+):(\d+)\)\s*$")
_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_pyspy(text: str) -> List[Thread]:
    """Threads of a ``py-spy dump --full-filenames`` output."""
    threads: List[Thread] = []
    for line in text.splitlines():
        head = _PYSPY_THREAD.match(line)
        if head:
            threads.append(Thread(head.group(3) or head.group(1)))
            continue
        frame = _PYSPY_FRAME.match(line)
        if frame and threads:
            threads[-1].frames.append(Frame(frame.group(1), frame.group(2), int(frame.group(3))))
    return threads


def parse_faulthandler(text: str) -> List[Thread]:
    """Threads of one faulthandler dump (the supervisor reads the stack file from where the dump began)."""
    threads: List[Thread] = []
    for line in text.splitlines():
        head = _FH_THREAD.match(line)
        if head:
            threads.append(Thread(("current thread " if head.group(1) == "Current thread" else "thread ")
                                  + head.group(2)))
            continue
        frame = _FH_FRAME.match(line)
        if frame and threads:
            threads[-1].frames.append(Frame(frame.group(3), frame.group(1), int(frame.group(2))))
    return threads


# ---------------------------------------------------------------------- taking
def pyspy_path() -> Optional[str]:
    """py-spy next to this interpreter, else on PATH; None when absent or ``$FABRICLITE_STACKS=handler``."""
    if os.environ.get(STACKS_ENV, "auto") == "handler":
        return None
    local = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return local if os.access(local, os.X_OK) else shutil.which("py-spy")


def rank_env(stack_file: str, pythonpath: str) -> Dict[str, str]:
    """What a rank's environment gets so that its bootstrap installs the handler writing to ``stack_file``
    (``pythonpath``: the rank's ``PYTHONPATH`` otherwise)."""
    if os.environ.get(STACKS_ENV, "auto") == "off":
        return {}
    path = [BOOTSTRAP_DIR] + [p for p in pythonpath.split(os.pathsep) if p]
    return {STACK_FILE_ENV: stack_file, "PYTHONPATH": os.pathsep.join(path)}


def _by_pyspy(exe: str, pid: int) -> Tuple[List[Thread], str]:
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid), "--full-filenames"], capture_output=True,
                              text=True, timeout=DUMP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        return [], f"py-spy: {err}"
    threads = parse_pyspy(done.stdout) if done.returncode == 0 else []
    return threads, "" if threads else f"py-spy: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"


def _by_handler(pid: int, stack_file: str) -> Tuple[List[Thread], str]:
    if not os.path.exists(stack_file):
        return [], "its stack handler is not installed yet (the interpreter is still starting)"
    start = os.path.getsize(stack_file)
    try:
        os.kill(pid, STACK_SIGNAL)
    except (ProcessLookupError, PermissionError) as err:
        return [], f"could not signal it ({err})"
    deadline, size, stable_since = time.monotonic() + DUMP_TIMEOUT_S, start, time.monotonic()
    while time.monotonic() < deadline:  # faulthandler writes in one go: wait until the file stops growing
        time.sleep(0.02)
        now_size = os.path.getsize(stack_file)
        if now_size != size:
            size, stable_since = now_size, time.monotonic()
        elif size > start and time.monotonic() - stable_since > 0.1:
            break
    with open(stack_file, errors="replace") as f:
        f.seek(start)
        text = f.read()
    threads = parse_faulthandler(text)
    return threads, "" if threads else "no answer to the stack signal (the handler was replaced, or the rank is " \
                                       "frozen outside Python)"


def take(ranks: Dict[int, Tuple[int, str]]) -> Dict[int, RankStack]:
    """Every thread's stack of each rank in ``ranks`` (global rank -> (pid, stack file)), all at once."""
    if os.environ.get(STACKS_ENV, "auto") == "off":
        return {}
    exe = pyspy_path() if os.environ.get(STACKS_ENV, "auto") != "handler" else None
    stacks: Dict[int, RankStack] = {}

    def one(rank: int, pid: int, stack_file: str) -> None:
        stack = RankStack(rank, pid)
        why = ""
        if exe is not None:
            stack.threads, why = _by_pyspy(exe, pid)
            stack.method = "py-spy dump"
        if not stack.threads and os.environ.get(STACKS_ENV, "auto") != "py-spy":
            stack.threads, why2 = _by_handler(pid, stack_file)
            stack.method = "faulthandler" + (f" ({why})" if why else "")
            why = why2
        stack.missing = "" if stack.threads else why
        stacks[rank] = stack

    workers = [threading.Thread(target=one, args=(r, pid, f), daemon=True) for r, (pid, f) in ranks.items()]
    for w in workers:
        w.start()
    for w in workers:
        w.join(DUMP_TIMEOUT_S * 2 + 1)
    return stacks


# ---------------------------------------------------------------------- the summary
def _waiting(stack: RankStack) -> bool:
    """Whether the rank's main thread waits on the others (backward, a collective, a barrier)."""
    if not stack.threads:
        return False
    main = next((t for t in stack.threads if t.name in ("MainThread", "current thread") or
                 t.name.startswith("current thread")), stack.threads[0])
    return any(f.function in ("backward", "_call", "barrier", "all_reduce", "wait", "_engine_run_backward")
               and not f.is_user for f in main.frames)


def _signature(stack: RankStack) -> Tuple:
    return tuple((t.name if not re.match(r"^(current )?thread 0x", t.name) and not t.name.isdigit() else "",
                  tuple(t.frames)) for t in stack.threads) or (stack.missing,)


def _format_thread(thread: Thread, indent: str) -> List[str]:
    user = [f for f in thread.frames if f.is_user]
    library = [f for f in thread.frames if not f.is_user]
    lines = [f"{indent}thread {thread.name!r}:" if not thread.name.startswith(("thread ", "current thread"))
             else f"{indent}{thread.name}:"]
    if user:
        lines.append(f"{indent}  your code (innermost first):")
        lines += [f"{indent}    {f}" for f in user]
    if library:
        shown = library[:LIBRARY_FRAMES_SHOWN]
        lines.append(f"{indent}  library (innermost first):")
        lines += [f"{indent}    {f}" for f in shown]
        if len(library) > len(shown):
            lines.append(f"{indent}    ... {len(library) - len(shown)} more library frames")
    if not thread.frames:
        lines.append(f"{indent}  (no Python frame)")
    return lines


def format_stacks(stacks: Dict[int, RankStack], records: Dict[int, Optional[dict]], node_rank: int,
                  why: str, stuck: Sequence[int] = ()) -> str:
    """The summary's stack section: ranks not waiting on the others (or named in ``stuck``) first, user frames
    before library frames, identical stacks merged ("ranks 0, 2, 3: ..."), each rank with its collective, the
    last it finished and its last optimizer step."""
    if not stacks:
        return ""
    method = sorted({s.method.split(" (")[0] for s in stacks.values() if s.method})
    lines = [f"--- live stacks of node {node_rank}'s ranks ({why}; all threads; {', '.join(method) or 'none'}) ---"]
    groups: Dict[Tuple, List[int]] = {}
    for rank in sorted(stacks):
        groups.setdefault(_signature(stacks[rank]), []).append(rank)

    def order(item: Tuple[Tuple, List[int]]) -> Tuple:
        ranks = item[1]
        first = stacks[ranks[0]]
        named = any(r in stuck for r in ranks)
        steps = min((records.get(r) or {}).get("steps", 0) for r in ranks)
        finished = min((records.get(r) or {}).get("finished", 0) for r in ranks)
        return (not named, _waiting(first), steps, finished, len(ranks), ranks[0])

    nccl = False
    for index, (_, ranks) in enumerate(sorted(groups.items(), key=order)):
        first = stacks[ranks[0]]
        label = "rank" if len(ranks) == 1 else "ranks"
        tag = ""
        if index == 0 and len(groups) > 1 and not _waiting(first):
            tag = "  <- not waiting on the others: the rank(s) the others wait for"
        lines.append(f"{label} {', '.join(map(str, ranks))}:{tag}")
        for r in ranks:
            record = records.get(r)
            nccl = nccl or bool(record and record.get("flags", 0) & rank_progress.FLAG_NCCL)
            lines.append(f"  rank {r} (pid {stacks[r].pid}): {rank_progress.describe(record)}")
        if first.missing:
            lines.append(f"  no stack: {first.missing}")
        # threads running the user's code first (the main thread first among them), then the library's own
        threads = sorted(first.threads, key=lambda t: not any(f.is_user for f in t.frames))
        for thread in threads:
            lines += _format_thread(thread, "  ")
    if nccl:
        lines.append(NCCL_HINT)
    return "\n".join(lines)
