"""The collectives' stages import only the stages before them.

The documented order (fabriclite/collectives/__init__.py) is structure -> plans -> packing -> header ->
unpacking. Each stage may import the stages before it and the modules below every stage (buffers, ops, state,
autograd, ...), as long as those in turn reach only earlier stages; never a later stage, not even under
``TYPE_CHECKING`` or inside a function. The imports are read from the source with ``ast``, so nothing is imported
to check them.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = "fabriclite.collectives"
SOURCE = Path(__file__).resolve().parents[3] / "fabriclite" / "collectives"
#: the documented order of the stages
STAGES = ["structure", "plans", "packing", "header", "unpacking"]
#: the module that holds what the stages share: it imports no stage
SHARED = "buffers"


def collective_imports(source: str) -> Set[str]:
    """The ``fabriclite.collectives`` submodules ``source`` imports anywhere (module level, functions,
    ``if TYPE_CHECKING:`` blocks), by their short name."""
    found: Set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name[len(PACKAGE) + 1:].split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == PACKAGE:  # from fabriclite.collectives import header
                found.update(alias.name for alias in node.names)
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module[len(PACKAGE) + 1:].split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 1:  # from .header import ...; from . import x
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def order_violations(sources: Dict[str, str]) -> List[str]:
    """Every import that breaks the order, as text; ``sources``: module short name -> its source."""
    direct = {name: collective_imports(text) & set(sources) for name, text in sources.items()}

    def reach(name: str, seen: Set[str]) -> Set[str]:
        """The stages ``name`` reaches through non-stage modules (itself excluded)."""
        out: Set[str] = set()
        for dep in direct.get(name, ()):
            if dep in STAGES:
                out.add(dep)
            elif dep not in seen:
                seen.add(dep)
                out |= reach(dep, seen)
        return out

    problems = []
    for name in STAGES:
        position = STAGES.index(name)
        for dep in sorted(direct.get(name, ())):
            via = {dep} if dep in STAGES else reach(dep, {dep, name})
            for stage in sorted(via):
                if STAGES.index(stage) >= position:
                    path = stage if dep == stage else f"{dep} -> {stage}"
                    problems.append(f"{name} imports {path}, which is not before it in {' -> '.join(STAGES)}")
    shared = reach(SHARED, {SHARED})
    problems += [f"{SHARED} (below every stage) imports the stage {stage}" for stage in sorted(shared)]
    return problems


def _sources() -> Dict[str, str]:
    return {path.stem: path.read_text() for path in SOURCE.glob("*.py") if path.stem != "__init__"}


def test_every_stage_imports_only_the_stages_before_it():
    sources = _sources()
    assert set(STAGES) | {SHARED} <= set(sources), sorted(sources)
    assert order_violations(sources) == []


def test_the_documented_order_is_the_one_checked():
    doc = (SOURCE / "__init__.py").read_text()
    assert "structure.py" in doc and "plans.py" in doc and "packing.py" in doc and "header.py" in doc
    positions = [doc.index(f"({stage}.py") for stage in STAGES]
    assert positions == sorted(positions), "the pipeline in __init__'s docstring lists the stages in another order"


@pytest.mark.parametrize("module, line", [
    ("header", "from fabriclite.collectives.unpacking import Slot"),  # a later stage
    ("packing", "from fabriclite.collectives.header import UNIT"),
    ("structure", "from fabriclite.collectives import plans"),
    ("plans", "from .packing import begin"),
    ("header", "if TYPE_CHECKING:\n    from fabriclite.collectives.packing import Row\n    "
               "from fabriclite.collectives.unpacking import Slot"),  # a backwards import
    ("packing", "def late():\n    import fabriclite.collectives.unpacking"),
    ("buffers", "from fabriclite.collectives.structure import Spec"),  # the shared module reaches a stage
    ("state", "from fabriclite.collectives.header import agree"),  # through a non-stage module
])
def test_an_import_against_the_order_is_found(module, line):
    """The check itself: each source above gets one import against the order added, and fails."""
    sources = _sources()
    sources[module] = sources[module] + "\n\n" + line + "\n"
    problems = order_violations(sources)
    assert problems, f"{module} with {line!r} passed"
    assert any(module in problem for problem in problems), problems


def test_allowed_imports_pass():
    sources = _sources()
    sources["unpacking"] += "\nfrom fabriclite.collectives.header import Gathered\nfrom . import structure\n"
    sources["header"] += "\nif TYPE_CHECKING:\n    from fabriclite.collectives.plans import Plan\n"
    assert order_violations(sources) == []
