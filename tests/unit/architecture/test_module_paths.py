"""Every module path the package spells as a string names a module that is there: the registries'
``"fabriclite.strategies.ddp:DDPStrategy"`` (the module, and a class or function it defines) and the warm spares'
preload lists (``"fabriclite.strategies.torchft.replica_parts"``), which import by name and would only be slower,
not fail, if a move left them behind. Read from the code (no import of the modules named, so no optional
package is needed): a string counts when it is a whole dotted path whose first part is a module or folder of
``fabriclite/``."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from helpers import REPO

PACKAGE = REPO / "fabriclite"
#: ``fabriclite.a.b`` or ``fabriclite.a.b:Name``
SPELLED = re.compile(r"fabriclite((?:\.\w+)+)(?::(\w+))?")


def spelled_paths() -> Iterator[Tuple[str, str]]:
    """(where, the string) for each string constant of the package that spells a module path."""
    tops = {path.stem for path in PACKAGE.iterdir() if path.suffix == ".py" or (path / "__init__.py").exists()}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                match = SPELLED.fullmatch(node.value)
                if match and match.group(1).split(".")[1] in tops:
                    yield f"{path.relative_to(REPO)}:{node.lineno}", node.value


def module_file(dotted: str) -> Optional[Path]:
    """The file of module ``dotted`` (``fabriclite.…``), or None."""
    base = REPO.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def defines(path: Path, name: str) -> bool:
    """Whether module ``path`` defines ``name`` at its top level (a class, a function or an assignment)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


def test_the_package_spells_module_paths_at_all() -> None:
    found = dict(spelled_paths())
    assert any(":" in value for value in found.values()), "no registry string found: is the check still reading?"
    assert any(value.startswith("fabriclite.strategies.torchft.") for value in found.values())


def test_every_spelled_module_path_is_there() -> None:
    missing: List[str] = []
    for where, value in spelled_paths():
        module, _, name = value.partition(":")
        path = module_file(module)
        if path is None:
            missing.append(f"{where}: {value!r} (no module {module})")
        elif name and not defines(path, name):
            missing.append(f"{where}: {value!r} ({module} defines no {name})")
    assert not missing, "\n".join(missing)
