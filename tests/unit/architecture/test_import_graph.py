"""The tree's rules, checked on the code: who may import whom, as docs/design.md ("The floors") writes them.

Every ``import`` of a ``fabriclite`` module in ``fabriclite/`` (those inside functions too) is an arrow. An arrow
between two folders must run down the floors (a floor never imports one above it nor a sibling on its own floor);
inside ``supervision/``, ``distributed/``, ``data/`` and ``strategies/`` the same holds for their sub-floors (a
sub-floor spelled "the rest" holds every part its line does not name, free to import one another). No module
imports itself back through the imports that run when it is imported (no cycle; an import inside a function, made
when it is called, is an arrow for the floors but not part of a cycle). And the torchft package is imported only
inside ``strategies/torchft/``. The floors are read from docs/design.md itself, so the page and the test cannot
drift apart."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

from helpers import REPO

PACKAGE = REPO / "fabriclite"
DESIGN = REPO / "docs" / "design.md"
#: the sub-floor of every part of a folder that its line does not name
REST = "the rest"


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def floors() -> Tuple[Dict[str, int], Dict[str, Dict[str, int]]]:
    """(top-level unit -> floor, folder -> (its unit -> sub-floor)), from docs/design.md's "The floors"."""
    section = _section(DESIGN.read_text(), "The floors")
    top: Dict[str, int] = {}
    for number, names in re.findall(r"^(\d+)\. (.+)$", section, re.M):
        for name in re.findall(r"`(\w+)`", names):
            top[name] = int(number)
    inner: Dict[str, Dict[str, int]] = {}
    for folder, order in re.findall(r"^- `(\w+)/`: (.+)$", section, re.M):
        inner[folder] = {name: level for level, part in enumerate(order.split(">"))
                         for name in re.findall(r"`(\w+)`", part) + ([REST] if REST in part else [])}
    return top, inner


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def modules() -> Dict[str, Path]:
    found = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: path for name, path in found.items() if ".bootstrap" not in name}  # run by path, never imported


def _statements(tree: ast.AST, eager: bool) -> List[ast.AST]:
    """Every node of ``tree``; ``eager``: only those that run at import time (not inside a function's body)."""
    found: List[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if eager and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def imports(name: str, path: Path, known: Set[str], eager: bool = False) -> Set[str]:
    """The fabriclite modules ``name`` imports (a ``from package import module`` counts as the module); ``eager``:
    only the imports that run when it is imported."""
    found: Set[str] = set()
    for node in _statements(ast.parse(path.read_text(), str(path)), eager):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: a relative import (fabriclite imports by absolute names)"
            base = node.module or ""
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m == "fabriclite" or m.startswith("fabriclite.")}


@functools.lru_cache(maxsize=None)
def graph(eager: bool = False) -> Dict[str, Set[str]]:
    """Module -> the fabriclite modules it imports (``eager``: at import time only)."""
    known = modules()
    return {name: {m for m in imports(name, path, set(known), eager) if m != name} for name, path in known.items()}


def unit(module: str) -> Tuple[str, str]:
    """(the top-level unit, the unit inside it): ``fabriclite.supervision.watch.hangs`` -> (supervision, watch)."""
    parts = module.split(".")[1:] or ["__init__"]
    return parts[0], (parts[1] if len(parts) > 1 else "")


def upward_arrows(edges: Dict[str, Set[str]], top: Dict[str, int], inner: Dict[str, Dict[str, int]]) -> List[str]:
    """The arrows of ``edges`` that run up (or sideways) the floors ``top`` and, inside a folder, ``inner``."""
    wrong = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            (a, a_in), (b, b_in) = unit(source), unit(target)
            assert a in top and b in top, f"{source} -> {target}: a folder docs/design.md's floors do not place"
            if a != b and top[a] >= top[b]:
                wrong.append(f"{source} -> {target} (floor {top[a]} -> {top[b]})")
            elif a == b and a in inner and a_in and b_in and a_in != b_in and _runs_up(inner[a], a_in, b_in):
                wrong.append(f"{source} -> {target} (inside {a}/: {a_in} may not import {b_in})")
    return wrong


def _runs_up(levels: Dict[str, int], source: str, target: str) -> bool:
    """Whether ``source`` may not import ``target``, two parts of one folder with the sub-floors ``levels``."""
    if source not in levels and target not in levels:
        return False  # two of "the rest"
    rest = levels.get(REST)
    assert rest is not None or {source, target} <= set(levels), f"{source}, {target}: a part the sub-floors miss"
    return levels.get(source, rest) >= levels.get(target, rest)


def third_party_imports(path: Path) -> Set[str]:
    """The top-level names of the packages other than fabriclite that ``path`` imports (inside functions too)."""
    found: Set[str] = set()
    for node in _statements(ast.parse(path.read_text(), str(path)), eager=False):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found - {"fabriclite"}


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected groups of more than one module in ``edges`` (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_floors_cover_every_folder():
    top, inner = floors()
    folders = {unit(name)[0] for name in modules()}
    assert folders <= set(top), f"folders docs/design.md's floors do not place: {sorted(folders - set(top))}"
    for folder, levels in inner.items():
        parts = {unit(name)[1] for name in modules() if unit(name)[0] == folder and unit(name)[1]}
        named = set(levels) - {REST}
        assert named <= parts, f"{folder}/'s sub-floors name parts it does not have: {sorted(named - parts)}"
        if REST not in levels:
            assert parts <= named, f"parts of {folder}/ its sub-floors do not place: {sorted(parts - named)}"


def test_no_arrow_runs_up_the_floors():
    assert upward_arrows(graph(), *floors()) == []


def test_no_module_imports_itself_back():
    assert cycles(graph(eager=True)) == []


def test_torchft_is_imported_only_in_its_folder():
    home = "fabriclite.strategies.torchft."
    outside = sorted(name for name, path in modules().items()
                     if not name.startswith(home) and "torchft" in third_party_imports(path))
    assert outside == [], f"modules outside fabriclite/strategies/torchft/ that import torchft: {outside}"
    assert "torchft" in third_party_imports(modules()["fabriclite.strategies.torchft.replica_parts"])


def test_the_check_finds_arrows_that_run_up_or_sideways():
    top, inner = floors()
    edges = {"fabriclite.distributed.rendezvous": {"fabriclite.supervision.agent.supervisor"},  # up
             "fabriclite.launchers.base": {"fabriclite.collectives.sync"},  # a sibling on the same floor
             "fabriclite.supervision.rank.child": {"fabriclite.supervision.watch.hangs"},  # up inside supervision/
             "fabriclite.supervision.agent.supervisor": {"fabriclite.supervision.watch.hangs",  # down: allowed
                                                         "fabriclite.distributed.rendezvous"},
             "fabriclite.strategies.ddp": {"fabriclite.strategies.torchft.replica_strategy"},  # up inside strategies/
             "fabriclite.strategies.torchft.diloco": {"fabriclite.strategies.ddp"},  # down: allowed
             "fabriclite.strategies.fsdp": {"fabriclite.strategies.ddp"}}  # two of "the rest": allowed
    assert len(upward_arrows(edges, top, inner)) == 4
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "fabriclite.supervision.rank.progress" in graph()["fabriclite.supervision.watch.hangs"]
