"""A rank's progress, shared with its node's supervisor through a small memory-mapped file: optimizer steps done
(and when), the collective it is in and the last one it finished, and its time outside collective waits (for the
straggler check).

The supervisor creates one file per rank (``$FABRICLITE_PROGRESS_FILE``, :data:`SIZE` bytes of zeros); the rank
maps it and writes fixed fields in place: no system call, no store traffic, no lock (each field has one writer;
a reader may see a field a moment old, never a torn 8-byte value on the platforms torch runs on). A rank with no
such file (no fabriclite supervisor: torchrun, srun, mpirun) records nothing and pays one ``None`` check.

A step is one call of the optimizer wrapper's ``step`` (``FabricOptimizer.step``), everywhere in fabriclite.
"""
from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import struct
import time
from typing import Any, ContextManager, Dict, Optional, Tuple

PROGRESS_FILE_ENV = "FABRICLITE_PROGRESS_FILE"
#: layout version (the first field), bumped when the fields change
VERSION = 1
# version, pid, steps, last step (unix time), entered #, finished #, busy ns (total), waits ns (total),
# waiting since (unix time, 0: not waiting), in collective (0/1), device flags, entered name, finished name,
# first step (unix time); written by the supervisor: the slowest rank (-1: none named) and how much slower
_FORMAT = "<qqqdqqqqdqq32s32sdqd"
SIZE = struct.calcsize(_FORMAT)
_STEPS, _LAST, _ENTERED, _FINISHED, _BUSY, _WAITS = 16, 24, 32, 40, 48, 56
_SINCE, _INSIDE, _FLAGS, _ENTERED_NAME, _FINISHED_NAME, _FIRST, _SLOWEST, _SLOWER = 64, 72, 80, 88, 120, 152, 160, 168
#: device flag: the rank's process group is NCCL (the summary points at NCCL's flight recorder)
FLAG_NCCL = 1
#: the rank's interpreter is exiting (its atexit handlers run): no more steps are to be expected
FLAG_EXITING = 2

_pack_q = struct.Struct("<q").pack_into
_pack_d = struct.Struct("<d").pack_into


class RankProgress:
    """This rank's record (see the module docstring). Every method costs a few hundred nanoseconds."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        struct.pack_into("<qq", self._map, 0, VERSION, os.getpid())
        self._steps = 0
        self._entered = self._finished = 0
        self._waits_ns = 0  # time inside collectives and backward (the gradient all-reduce's wait) so far
        self._wait_start = 0
        self._depth = 0
        self._cycle_start = time.perf_counter_ns()
        self._busy_ns = 0
        self._flags = 0
        atexit.register(self.set_flags, FLAG_EXITING)  # the end of the script is no hang

    @property
    def steps(self) -> int:
        """Optimizer steps this process made."""
        return self._steps

    # ------------------------------------------------------------------ steps
    def step_done(self) -> None:
        """One optimizer step ended: count it, and add its time outside waits to the busy total."""
        now = time.perf_counter_ns()
        self._busy_ns += max(0, now - self._cycle_start - self._waits_ns)
        self._cycle_start, self._waits_ns = now, 0
        self._steps += 1
        m = self._map
        _pack_q(m, _BUSY, self._busy_ns)
        wall = time.time()
        if self._steps == 1:
            _pack_d(m, _FIRST, wall)
        _pack_d(m, _LAST, wall)
        _pack_q(m, _STEPS, self._steps)

    # ------------------------------------------------------------------ waits
    def wait_started(self) -> None:
        """A wait on the other ranks begins (a collective, or backward with its gradient all-reduce)."""
        if self._depth == 0:
            self._wait_start = time.perf_counter_ns()
            _pack_d(self._map, _SINCE, time.time())
        self._depth += 1

    def wait_ended(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._waits_ns += time.perf_counter_ns() - self._wait_start
            _pack_d(self._map, _SINCE, 0.0)

    def __enter__(self) -> "RankProgress":
        """``with record:`` brackets a wait on the other ranks (wait_started / wait_ended)."""
        self.wait_started()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait_ended()

    def collective_entered(self, name: str, number: int) -> None:
        """This rank entered collective ``name`` #``number`` (the collective watch's count)."""
        self._entered = number
        m = self._map
        struct.pack_into("<32s", m, _ENTERED_NAME, name.encode()[:32])
        _pack_q(m, _ENTERED, number)
        _pack_q(m, _INSIDE, 1)
        self.wait_started()

    def collective_finished(self, name: str, number: int) -> None:
        """Collective ``name`` #``number`` completed on this rank."""
        self.wait_ended()
        m = self._map
        struct.pack_into("<32s", m, _FINISHED_NAME, name.encode()[:32])
        _pack_q(m, _FINISHED, number)
        _pack_q(m, _INSIDE, 0)

    def set_flags(self, flags: int) -> None:
        """Add ``flags`` (FLAG_*) to the record's."""
        self._flags |= flags
        _pack_q(self._map, _FLAGS, self._flags)

    def slowest(self) -> Optional[Tuple[int, float]]:
        """The straggler the supervisor named (global rank, fraction slower than the median), or None."""
        rank, slower = struct.unpack_from("<qd", self._map, _SLOWEST)
        return (rank, slower) if slower > 0 else None


_progress: Optional[RankProgress] = None
_opened = False


def progress() -> Optional[RankProgress]:
    """This rank's record, or None where no supervisor gave one (opened on the first call)."""
    global _progress, _opened
    if not _opened:
        _opened = True
        path = os.environ.get(PROGRESS_FILE_ENV)
        if path and os.path.exists(path):
            try:
                _progress = RankProgress(path)
            except (OSError, ValueError):
                _progress = None
    return _progress


_NOT_RECORDED = contextlib.nullcontext()


def waiting(enabled: bool = True) -> ContextManager[Any]:
    """A ``with`` block that counts as a wait on the other ranks in this rank's record (not busy time, for the
    stragglers; the hang watch sees where it waits); nothing where no supervisor gave a record or not ``enabled``."""
    record = progress() if enabled else None
    return record if record is not None else _NOT_RECORDED


def create(path: str) -> None:
    """(Supervisor) a fresh, zeroed record at ``path``."""
    with open(path, "wb") as f:
        f.write(b"\0" * SIZE)


def read(path: str) -> Optional[Dict[str, Any]]:
    """(Supervisor) the record at ``path`` as a dict; None if it cannot be read or no rank has opened it yet."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SIZE)
    except OSError:
        return None
    if len(raw) < SIZE:
        return None
    (version, pid, steps, last, entered, finished, busy, _waits, since, inside, flags, entered_name,
     finished_name, first, _slowest, _slower) = struct.unpack(_FORMAT, raw)
    if version == 0:
        return None
    return {"version": version, "pid": pid, "steps": steps, "last_step_time": last or None, "entered": entered,
            "finished": finished, "busy_ns": busy, "waiting_since": since or None, "first_step_time": first or None, "inside": bool(inside), "flags": flags,
            "entered_name": entered_name.rstrip(b"\0").decode(errors="replace"),
            "finished_name": finished_name.rstrip(b"\0").decode(errors="replace")}


def describe(record: Optional[Dict[str, Any]]) -> str:
    """"in all_reduce #5; last finished all_reduce #4; last optimizer step 3 (2.1 s ago)"."""
    if record is None:
        return "no progress reported (the rank had not joined yet)"
    parts = []
    since = record.get("waiting_since")
    waited = f" for {time.time() - since:.1f} s" if since else ""
    if record["inside"]:
        parts.append(f"in {record['entered_name']} #{record['entered']}{waited}")
    elif since:
        parts.append(f"in backward{waited} (where DDP's gradient all-reduce waits for every rank)")
    else:
        parts.append("in no collective")
    if record["finished"]:
        parts.append(f"last finished {record['finished_name']} #{record['finished']}")
    else:
        parts.append("no collective finished")
    if record["steps"]:
        age = time.time() - record["last_step_time"] if record["last_step_time"] else None
        parts.append(f"last optimizer step {record['steps']}" + (f" ({age:.1f} s ago)" if age is not None else ""))
    else:
        parts.append("no optimizer step yet")
    return "; ".join(parts)


def write_slowest(path: str, rank: int, slower: float) -> None:
    """(Supervisor) tell the rank of record ``path`` which rank is the slowest (``slower`` 0: none)."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return
    try:
        os.pwrite(fd, struct.pack("<qd", rank, slower), _SLOWEST)
    finally:
        os.close(fd)
