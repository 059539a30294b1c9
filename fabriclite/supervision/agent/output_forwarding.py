"""Per-rank output handling for supervised ranks: an optional "[rank N]" prefix on every line and
optional per-rank log files (like torchrun's --tee / --log-dir).

Popen ranks (script mode, ``fabriclite run``) get pipes through ``popen_kwargs()``; spawn/fork ranks
get the write ends of ``open_pipes()`` and point their stdout/stderr there (``redirect_output``).
The supervisor forwards every line, prefixed, to its own stdout/stderr and to ``LOG_DIR/rank_N.log``.

Lines stay whole: a rank's stdout / stderr are line-buffered once it joins (``line_buffer_stdio``: one write
per line, atomic on a shared pipe up to 4 KiB), and the supervisor writes each rank's complete lines under one
lock per stream. A progress bar redrawing with ``\r`` is forwarded as it is drawn; another rank's line arriving
meanwhile starts on a new line instead of being glued to the bar.
"""
from __future__ import annotations

import codecs
import io
import os
import re
import select
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import IO, Any, Dict, List, Optional, Tuple

from fabriclite.supervision.watch.events import LOG_DIR_ENV
from fabriclite.supervision.watch.goodput import goodput_from_env

PREFIX_ENV = "FABRICLITE_RANK_PREFIX"
_TRUE = ("1", "true", "yes", "on")


@dataclass
class OutputOptions:
    """``prefix``: prefix each line with ``[rank N]``; ``log_dir``: also write ``rank_N.log`` there (and the events
    record); ``goodput``: when node 0 prints the goodput line (``auto``, ``always``, ``never``: see
    supervision/watch/goodput.py)."""

    prefix: bool = False
    log_dir: Optional[str] = None
    goodput: str = "auto"
    _threads: List[threading.Thread] = field(default_factory=list, repr=False)
    _files: List[IO[str]] = field(default_factory=list, repr=False)

    @classmethod
    def from_env(cls) -> "OutputOptions":
        """From $FABRICLITE_RANK_PREFIX (1/true/yes/on), $FABRICLITE_LOG_DIR and $FABRICLITE_GOODPUT (ValueError
        naming a bad one)."""
        prefix = os.environ.get(PREFIX_ENV, "").lower() in _TRUE
        return cls(prefix=prefix, log_dir=os.environ.get(LOG_DIR_ENV) or None, goodput=goodput_from_env())

    @property
    def captures(self) -> bool:
        """Whether ranks' output goes through the supervisor (prefix or log files asked for)."""
        return self.prefix or self.log_dir is not None

    def child_env(self) -> Dict[str, str]:
        """Variables for a captured rank: Python output unbuffered, so lines arrive as printed, and
        $FABRICLITE_RANK_PREFIX when lines are prefixed (see ``prefixed_by_supervisor``)."""
        env = {}
        if self.captures and "PYTHONUNBUFFERED" not in os.environ:
            env["PYTHONUNBUFFERED"] = "1"
        if self.prefix:
            env[PREFIX_ENV] = "1"
        return env

    def popen_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for ``subprocess.Popen`` so that ``attach(rank, process)`` can forward."""
        if not self.captures:
            return {}
        return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}

    def attach(self, global_rank: int, process: "subprocess.Popen[Any]") -> None:
        """Forward ``process``'s output (started with ``popen_kwargs()``) line by line."""
        if self.captures:
            self.attach_streams(global_rank, process.stdout, process.stderr)

    def open_pipes(self) -> Optional[Tuple[Tuple[int, int], Tuple[int, int]]]:
        """For a spawn/fork rank: ((stdout read, write), (stderr read, write)) file descriptors, or
        None when nothing is captured. Pass the write ends to the rank (``redirect_output``), close
        them here once it started, and ``attach_fds`` the read ends."""
        if not self.captures:
            return None
        return os.pipe(), os.pipe()

    def attach_fds(self, global_rank: int, stdout_fd: int, stderr_fd: int) -> None:
        """Forward what is written to the pipes whose read ends are ``stdout_fd`` / ``stderr_fd``."""
        self.attach_streams(global_rank, os.fdopen(stdout_fd, "rb"), os.fdopen(stderr_fd, "rb"))

    def attach_streams(self, global_rank: int, stdout: Optional[IO[bytes]], stderr: Optional[IO[bytes]]) -> None:
        """Forward two binary streams of rank ``global_rank`` line by line until they end."""
        log: Optional[IO[str]] = None
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            log = open(os.path.join(self.log_dir, f"rank_{global_rank}.log"), "a", buffering=1,
                       encoding="utf-8", errors="replace")
            self._files.append(log)
        tag = f"[rank {global_rank}] " if self.prefix else ""
        lock = threading.Lock()
        for stream, sink in ((stdout, sys.stdout), (stderr, sys.stderr)):
            thread = threading.Thread(target=_pump, args=(stream, sink, global_rank, tag, log, lock), daemon=True,
                                      name=f"fabriclite-output-{global_rank}")
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Wait (up to 2 s per stream) for the forwarded streams to end; close the log files."""
        for thread in self._threads:
            thread.join(timeout=2)
        for f in self._files:
            f.close()
        self._threads.clear()
        self._files.clear()


def prefixed_by_supervisor() -> bool:
    """In a rank: whether the supervisor prefixes each of its lines with ``[rank N]`` (so the rank
    should not add a prefix of its own, as torch's excepthook does)."""
    return os.environ.get(PREFIX_ENV, "").lower() in _TRUE


def redirect_output(stdout_fd: int, stderr_fd: int) -> None:
    """In a spawn/fork rank: send this process's stdout / stderr (file descriptors 1 and 2, so
    C-level output too) to the given pipe write ends, line-buffered."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    for fd in {stdout_fd, stderr_fd} - {1, 2}:
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)


def line_buffer_stdio() -> None:
    """In a rank: make ``sys.stdout`` / ``sys.stderr`` line-buffered and not write-through (even under
    PYTHONUNBUFFERED=1), so that each ``print`` reaches the shared terminal or pipe in one write (text and
    newline together; a ``\r`` flushes too, so progress bars stay live). Streams that are not
    ``io.TextIOWrapper`` (replaced by the user or a notebook) are left alone."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            try:
                stream.reconfigure(line_buffering=True, write_through=False)
            except (ValueError, OSError):  # closed or detached
                pass


class _Terminal:
    """The supervisor's stdout and stderr as every rank's pump shares them: whole writes under one lock, and
    the one (rank, stream) whose partial line (a progress bar) is open, so that any other write starts on a
    new line instead of being glued to it (the bar redraws on that new line)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: Optional[Tuple[Tuple[int, int], IO[str]]] = None
        self.last_char: Dict[Tuple[int, int], str] = {}
        self.interrupted: set = set()

    def write(self, stream: IO[str], rank: int, text: str, tag: str) -> None:
        key = (rank, id(stream))
        with self.lock:
            if self.open is not None and self.open[0] != key:
                _emit(self.open[1], "\n")
                self.interrupted.add(self.open[0])
                self.open = None
            if key in self.interrupted:
                self.interrupted.discard(key)
                text = text[1:] if text.startswith("\n") else text  # that line was ended for it
            if not text:
                return
            at_start = self.open is None or self.last_char.get(key) == "\r"
            _emit(stream, _tag_lines(text, tag, at_start) if tag else text)
            self.last_char[key] = text[-1]
            self.open = None if text.endswith("\n") else (key, stream)


def _emit(stream: IO[str], text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass


_TERMINAL = _Terminal()
#: where a "[rank N] " tag goes: after a newline or carriage return that more text follows (not "\r\n")
_LINE_STARTS = re.compile(r"(?<=\n)(?=.)|(?<=\r)(?=[^\n])", re.S)


def _tag_lines(text: str, tag: str, at_start: bool) -> str:
    text = _LINE_STARTS.sub(lambda _: tag, text)
    return tag + text if at_start and not text.startswith("\r") else text


def _pump(stream: Optional[IO[bytes]], sink: IO[str], rank: int, tag: str, log: Optional[IO[str]],
          lock: threading.Lock) -> None:
    """Forward ``stream`` to ``sink`` until it ends: complete lines as they arrive, a partial line with a
    ``\r`` (a progress bar) at once, another partial line when nothing more follows within 50 ms."""
    if stream is None:
        return
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with stream:
        fd = stream.fileno()
        poller = select.poll()  # no FD_SETSIZE limit, unlike select()
        poller.register(fd, select.POLLIN)
        pending = b""
        while True:
            if pending and b"\r" not in pending and not poller.poll(50):
                _forward(sink, rank, tag, log, lock, decoder.decode(pending))  # a flush mid-line: show it
                pending = b""
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            pending += chunk
            cut = pending.rfind(b"\n") + 1
            if b"\r" in pending[cut:]:
                cut = len(pending)
            if cut:
                _forward(sink, rank, tag, log, lock, decoder.decode(pending[:cut]))
                pending = pending[cut:]
        if pending:
            _forward(sink, rank, tag, log, lock, decoder.decode(pending + b"\n", final=True))


def _forward(sink: IO[str], rank: int, tag: str, log: Optional[IO[str]], lock: threading.Lock, text: str) -> None:
    _TERMINAL.write(sink, rank, text, tag)
    if log is not None:
        with lock:
            try:
                log.write(text)
            except ValueError:  # closed after the supervisor stopped waiting
                pass
