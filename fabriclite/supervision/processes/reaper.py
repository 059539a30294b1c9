"""The reaper: a tiny process that outlives a killed supervisor just long enough to kill its ranks'
process groups.

Ranks already die with their supervisor (PR_SET_PDEATHSIG), but what a rank started (a helper
process, a shell command) is the rank's child, not the supervisor's, and would be left running.
The supervisor tells the reaper (over a pipe) which process groups it runs; when the pipe ends
without a goodbye, because the supervisor is gone, even by SIGKILL, the reaper SIGKILLs those
groups. A bare interpreter (``python -I -S``, no imports) costs ~20 ms to start.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Optional

_CODE = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
groups = set()
for line in sys.stdin:  # ends when every writer is gone: the supervisor ended or was killed
    op, pgid = line[0], int(line[1:])
    if op == "+":
        groups.add(pgid)
    else:
        groups.discard(pgid)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class Reaper:
    """Kills the process groups it is told to ``watch`` if the supervisor dies before it
    ``forget``\\ s them. ``fd``: the pipe's write end, which no rank may keep open (fork children
    close it). ``close()`` ends it without killing anything forgotten."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        try:
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CODE], stdin=subprocess.PIPE,
                                          start_new_session=True, close_fds=True, text=True)
        except OSError:  # pragma: no cover - no second process: the ranks still die with PDEATHSIG
            self._proc = None

    @property
    def fd(self) -> Optional[int]:
        """The write end of the pipe to the reaper (None if it could not start)."""
        return self._proc.stdin.fileno() if self._proc is not None and self._proc.stdin else None

    def watch(self, pgid: int) -> None:
        """Kill process group ``pgid`` if the supervisor dies."""
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        """``pgid`` is gone (its number may be reused): do not kill it."""
        self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line)
            self._proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        """End the reaper (after ``forget``-ting every group that is gone); waits up to 5 s."""
        if self._proc is None:
            return
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
        self._proc = None
