"""Who is writing a checkpoint, and whether that writer is dead: what lets a later save remove what a killed writer
left behind (its temporaries, its checkpoint published but never recorded) and never touch a live one's.

A writer is the process of global rank 0 that saves with ``keep=``: ``{"host", "pid", "start"}``, its host name,
pid and start time (clock ticks since boot, field 22 of ``/proc/<pid>/stat``; 0 where there is no ``/proc``).
Its *token*, ``<host>~<pid>~<start>``, is in the names of the temporaries it writes
(``.step-5.ckpt.tmp-<run id>-<token>-<random>``) and in its pending manifest entries.

Dead or alive:

- on the same host: dead when ``/proc/<pid>`` is gone or holds a process that started at another time (the pid
  was reused);
- on another host (a spot machine's restart, a requeue elsewhere): a writer holds an exclusive ``flock`` on
  ``.fabriclite-writer-<token>.lock`` in the checkpoint directory while it saves there, from its pending entry
  until the checkpoint is recorded (the kernel drops the lock when the process dies, SIGKILL included; a save
  that ends deletes the file). The writer counts as dead (done writing) when that file is gone or its lock can be
  taken. This relies on ``flock`` working across the hosts that share the directory, as the manifest's lock
  already does;
- an fsspec URL has no lock: a writer on another host is taken to be alive (never touched), and one job per
  directory holds there, as before.
"""
from __future__ import annotations

import atexit
import os
import re
import socket
from typing import Any, Dict, Optional, Tuple

#: a writer's token inside a name: ``<host>~<pid>~<start>`` (the host with anything but letters, digits and dots
#: replaced by ``_``)
TOKEN = re.compile(r"(?P<host>[A-Za-z0-9._]+)~(?P<pid>\d+)~(?P<start>\d+)")
LOCK_PREFIX = ".fabriclite-writer-"
LOCK_SUFFIX = ".lock"

Writer = Dict[str, Any]


def host() -> str:
    """This host's name as tokens carry it."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "localhost"


def start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot), 0 where there is no ``/proc``, None when there is no
    such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except FileNotFoundError:
        return None
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def me() -> Writer:
    """This process as a writer."""
    return {"host": host(), "pid": os.getpid(), "start": start_ticks(os.getpid()) or 0}


def token(writer: Writer) -> str:
    return f"{writer['host']}~{writer['pid']}~{writer['start']}"


def parse(name: str) -> Optional[Writer]:
    """The writer whose token a temporary's (or writer lock's) name carries, or None (an older fabriclite's name)."""
    found = None
    for found in TOKEN.finditer(name):
        pass
    if found is None:
        return None
    return {"host": found["host"], "pid": int(found["pid"]), "start": int(found["start"])}


def lock_path(directory: str, writer: Writer) -> str:
    return os.path.join(directory, f"{LOCK_PREFIX}{token(writer)}{LOCK_SUFFIX}")


def is_dead(writer: Optional[Writer], directory: Optional[str] = None) -> bool:
    """Whether ``writer`` is known to be dead (module docstring). ``directory``: the local checkpoint directory
    that holds its lock (None or a URL: a writer on another host is taken to be alive). Never True for this
    process. Call under the directory's manifest lock (a writer takes its own lock under it)."""
    if not writer:
        return False
    if writer["host"] == host():
        started = start_ticks(int(writer["pid"]))
        return started is None or (started != 0 and writer["start"] != 0 and started != int(writer["start"]))
    if directory is None or "://" in directory:
        return False
    import fcntl

    path = lock_path(directory, writer)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # drops the lock if it was taken
    return True


class WriterLock:
    """The writer's lock files, one per local checkpoint directory it is saving into: taken when a save begins,
    dropped (and the file deleted) once it is recorded or failed. A writer killed mid-save leaves an unlocked file,
    which the next save removes."""

    def __init__(self) -> None:
        self._held: Dict[str, Tuple[int, str]] = {}
        self._at_exit = False

    def hold(self, directory: str) -> None:
        """Take this process's writer lock in the local ``directory`` (nothing on a URL, nothing when held). Call
        under the directory's manifest lock."""
        if "://" in directory or directory in self._held:
            return
        import fcntl

        path = lock_path(directory, me())
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another Fabric of this process holds it (the name is this process's alone)
            os.close(fd)
            return
        self._held[directory] = (fd, path)
        if not self._at_exit:  # a background save that failed is never recorded: its lock goes at exit
            self._at_exit = True
            atexit.register(self.release_all)

    def release(self, directory: str) -> None:
        """Delete the lock file of ``directory`` and drop the lock (if held)."""
        fd, path = self._held.pop(directory, (-1, ""))
        if fd < 0:
            return
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)

    def release_all(self) -> None:
        """``release`` every lock held (at exit, after the interpreter waited for background saves)."""
        for directory in list(self._held):
            self.release(directory)


__all__ = ["LOCK_PREFIX", "LOCK_SUFFIX", "Writer", "WriterLock", "host", "is_dead", "lock_path", "me", "parse",
           "start_ticks", "token"]
