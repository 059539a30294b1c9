"""The Launcher seam: how the processes of one node start."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable


class Launcher(ABC):
    """Starts this node's ranks and supervises them.

    ``launch(fn, *args, **kwargs)`` returns rank 0's result for in-process launchers (spawn/fork);
    the script launcher turns the calling process into a supervisor that never returns: it exits with
    the job's exit code.
    """

    #: whether it works from an interactive session (a notebook): only fork-based launchers do
    is_interactive_compatible: bool = False

    @abstractmethod
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` on every local rank."""
