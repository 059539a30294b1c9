"""fabriclite's rank bootstrap: the supervisor puts this folder first on a rank's ``PYTHONPATH``, so that Python
runs this at start-up, before torch or the script is imported. It installs the stack handler
(``fabriclite.supervision.rank.child.install_stack_handler``, loaded by path: importing the fabriclite package
would import torch), takes this folder off ``PYTHONPATH`` and ``sys.path`` again, and runs the ``sitecustomize``
that this one hid, if any. Standard library only."""
import importlib.util
import os
import sys


def _bootstrap() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in path if p and os.path.abspath(p) != here)
    if not os.environ["PYTHONPATH"]:
        del os.environ["PYTHONPATH"]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.util.spec_from_file_location(
        "_fabriclite_rank_bootstrap", os.path.join(os.path.dirname(here), "child.py"))
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.install_stack_handler()
    me = sys.modules.pop("sitecustomize", None)
    try:  # the sitecustomize this one hid (a site's or a virtual environment's), which takes this one's place
        import sitecustomize  # noqa: F401
    except ImportError:
        if me is not None:
            sys.modules["sitecustomize"] = me  # none: the import machinery expects this module back


_bootstrap()
