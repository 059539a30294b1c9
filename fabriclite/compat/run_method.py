"""The ``run`` override pattern (Lightning Fabric 2.6): a ``Fabric`` subclass puts its training code in
``run(*args, **kwargs)``; calling ``fabric.run(...)`` launches the processes (as ``launch`` does) and runs the
method on every rank with those arguments.

As Lightning: ``Fabric.__init__`` replaces the instance's ``run`` with a launcher of the class's ``run``
(``prepare``); overriding ``run`` in a script started by a CLI (`fabriclite run`, `fabric run`) is a TypeError.
Calling ``run`` once the Fabric has joined the job runs it on this rank without launching again.
"""
from __future__ import annotations

import inspect
from typing import Any


class RunLauncher:
    """``fabric.run(*args, **kwargs)``: launch (or, once joined, just call) the class's ``run`` on every rank.

    Picklable (spawned ranks receive the Fabric, this included); returns what ``launch`` returns: each rank's
    own result in script mode, rank 0's for spawn / fork strategies.
    """

    def __init__(self, fabric: Any) -> None:
        self.fabric = fabric

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fabric = self.fabric
        if fabric._launched:
            return call_run(fabric, *args, **kwargs)
        return fabric.launch(call_run, *args, **kwargs)

    def __repr__(self) -> str:
        return f"RunLauncher({type(self.fabric).__name__}.run)"


def call_run(fabric: Any, *args: Any, **kwargs: Any) -> Any:
    """The class's own ``run`` (the user's override), bypassing the instance's launcher."""
    return type(fabric).run(fabric, *args, **kwargs)


def is_overridden(fabric: Any, base: type) -> bool:
    """Whether ``type(fabric)`` (a subclass of ``base``) defines its own ``run``."""
    return getattr(type(fabric), "run", None) is not getattr(base, "run", None)


def prepare(fabric: Any, base: type, cli: bool) -> None:
    """Wrap ``fabric.run`` so that calling it launches; TypeError (Lightning's) when ``run`` is overridden and a
    CLI started the script, before anything starts."""
    if cli and is_overridden(fabric, base):
        raise TypeError("Overriding `Fabric.run()` and launching from the CLI is not allowed. Run the script normally, "
                        "or change your code to directly call `fabric = Fabric(...); fabric.setup(...)` etc.")
    fabric.run = RunLauncher(fabric)


def do_nothing(*_: Any) -> None:
    """The default ``function`` of ``Fabric.launch`` (Lightning's ``_do_nothing``): only start or join the processes.
    A sentinel, so that ``launch(None)`` is told apart from ``launch()``."""


def check_function(function: Any) -> None:
    """Lightning's checks of ``launch(function)``: a callable that takes at least the Fabric (``do_nothing``, the
    default, passes). TypeError otherwise, ``None`` included: ``launch(train(fabric))`` passes train's result."""
    if function is do_nothing:
        return
    if not callable(function):
        raise TypeError(f"launch(function={function!r}): expected a callable taking the Fabric as first argument, or "
                        "nothing. HINT: do `.launch(your_fn)` instead of `.launch(your_fn())`.")
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return
    if not params:
        raise TypeError(f"launch(function={function!r}) needs to take at least one argument: the launcher passes the "
                        "Fabric to it.")
