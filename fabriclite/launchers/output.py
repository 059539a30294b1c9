"""Per-rank output handling for supervised ranks: an optional "[rank N]" prefix on every line and
optional per-rank log files (like torchrun's --tee / --log-dir)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import IO, Any, Dict, List, Optional

PREFIX_ENV = "FABRICLITE_RANK_PREFIX"
LOG_DIR_ENV = "FABRICLITE_LOG_DIR"


@dataclass
class OutputOptions:
    """``prefix``: prefix each line with ``[rank N]``; ``log_dir``: also write ``rank_N.log`` there."""

    prefix: bool = False
    log_dir: Optional[str] = None
    _threads: List[threading.Thread] = field(default_factory=list, repr=False)
    _files: List[IO[str]] = field(default_factory=list, repr=False)

    @classmethod
    def from_env(cls) -> "OutputOptions":
        """From $FABRICLITE_RANK_PREFIX (1/true) and $FABRICLITE_LOG_DIR."""
        prefix = os.environ.get(PREFIX_ENV, "").lower() in ("1", "true", "yes")
        return cls(prefix=prefix, log_dir=os.environ.get(LOG_DIR_ENV) or None)

    @property
    def captures(self) -> bool:
        return self.prefix or self.log_dir is not None

    def popen_kwargs(self) -> Dict[str, Any]:
        if not self.captures:
            return {}
        return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "bufsize": 1, "text": True,
                "errors": "replace"}

    def attach(self, global_rank: int, process: "subprocess.Popen[str]") -> None:
        """Forward ``process``'s output (started with ``popen_kwargs()``) line by line."""
        if not self.captures:
            return
        log: Optional[IO[str]] = None
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            log = open(os.path.join(self.log_dir, f"rank_{global_rank}.log"), "a", buffering=1)
            self._files.append(log)
        tag = f"[rank {global_rank}] " if self.prefix else ""
        lock = threading.Lock()
        for stream, sink in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
            thread = threading.Thread(target=_pump, args=(stream, sink, tag, log, lock), daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        for thread in self._threads:
            thread.join(timeout=2)
        for f in self._files:
            f.close()
        self._threads.clear()
        self._files.clear()


def _pump(stream: Optional[IO[str]], sink: IO[str], tag: str, log: Optional[IO[str]], lock: threading.Lock) -> None:
    if stream is None:
        return
    for line in stream:
        sink.write(tag + line)
        sink.flush()
        if log is not None:
            with lock:
                log.write(line)
    stream.close()
