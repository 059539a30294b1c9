"""API conformance against the installed Lightning Fabric (issues 12 and 21).

For each module of ``lightning.fabric`` that users import from (the package, strategies, accelerators, plugins,
loggers, utilities, wrappers, and plugins.environments), every public name (``__all__`` where the
module defines it; elsewhere its non-underscore classes and functions from ``lightning.fabric``) must exist at
the mirrored ``fabriclite`` path. For a class, so must each of its non-underscore methods and properties, and
every public callable (function, method, ``__init__``) is compared parameter by parameter: each of Lightning's
parameters exists in fabriclite with the same name, the same kind (positional-or-keyword, keyword-only, ...), the
same position when it is positional and the same default; fabriclite may add parameters that have a default. A
signature that ``inspect`` cannot read fails. A Lightning property may be a property or an attribute every instance
gets in ``__init__``.

The exceptions are the rows of the table in docs/compat.md, which this test reads: an ``absent`` row exempts its
name and everything under it; ``Name(param)`` exempts one parameter; a ``different`` row for a callable exempts its
whole signature only where one side takes nothing but ``*args, **kwargs``, and otherwise only what is not a
signature (a method in Lightning that is an attribute here, a member's existence under a ``different`` class).
A row for a member covers the same member of the Lightning subclasses. The rows are checked too: each names a real
Lightning object, an ``absent`` one is really absent from fabriclite, the others really present.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import textwrap
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import pytest

import lightning.fabric  # noqa: F401  (a test dependency: pinned in pyproject's test extras)
from helpers import REPO

COMPAT_MD = REPO / "docs" / "compat.md"

#: Lightning module -> the prefix of its names in docs/compat.md ("" for the package itself)
MODULES: Dict[str, str] = {
    "lightning.fabric": "",
    "lightning.fabric.strategies": "strategies.",
    "lightning.fabric.accelerators": "accelerators.",
    "lightning.fabric.plugins": "plugins.",
    "lightning.fabric.loggers": "loggers.",
    "lightning.fabric.utilities": "utilities.",
    "lightning.fabric.wrappers": "wrappers.",
    "lightning.fabric.plugins.environments": "plugins.environments.",
}
STATUSES = ("same", "different", "absent")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|\s*$")


# ---------------------------------------------------------------------------------------------- the table
def read_table(text: str) -> Dict[str, Tuple[str, str, str]]:
    """``{name: (status, why, alternative)}`` from the compat table's rows (``| `Name` | status | why | alt |``).
    Raises ValueError on a malformed or repeated row."""
    rows: Dict[str, Tuple[str, str, str]] = {}
    in_table = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("| Name | Status | Why | Alternative |"):
            in_table = True
            continue
        if not in_table or re.match(r"^\|[-| ]+\|$", line):
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        match = ROW.match(line)
        if match is None:
            raise ValueError(f"docs/compat.md line {number}: not a `| `Name` | Status | Why | Alternative |` row: "
                             f"{line!r}")
        name, status, why, alternative = match.groups()
        if name in rows:
            raise ValueError(f"docs/compat.md line {number}: {name!r} has two rows")
        rows[name] = (status, why, alternative)
    return rows


@pytest.fixture(scope="module")
def table() -> Dict[str, Tuple[str, str, str]]:
    return read_table(COMPAT_MD.read_text())


# ---------------------------------------------------------------------------------------------- Lightning's surface
def public_names(module_name: str) -> List[str]:
    """The public names of a Lightning module: ``__all__``, else its non-underscore classes and functions
    from ``lightning.fabric``."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return sorted(module.__all__)
    return sorted(name for name, value in vars(module).items()
                  if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
                  and getattr(value, "__module__", "").startswith("lightning.fabric"))


def members(cls: type) -> Iterator[Tuple[str, Any]]:
    """``(name, raw attribute)`` for a class's non-underscore methods and properties (inherited ones
    included, except those of builtin bases such as ``str``) and ``__init__``."""
    seen = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__ == "builtins":  # str's methods (StrEnum) are not Lightning's surface
            continue
        for name, value in vars(klass).items():
            if name in seen or (name.startswith("_") and name != "__init__"):
                continue
            seen.add(name)
            if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value) \
                    or type(value).__name__ == "cached_property":
                yield name, value


# ---------------------------------------------------------------------------------------------- comparing
_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def mirror(module_name: str) -> str:
    return "fabriclite" + module_name[len("lightning.fabric"):]


def resolve(module_name: str, name: str) -> Any:
    """fabriclite's object at the mirrored path, or None when the module or the name is missing."""
    try:
        module = importlib.import_module(mirror(module_name))
    except ImportError:
        return None
    return getattr(module, name, None)


def row(table: Dict[str, Tuple[str, str, str]], names: List[str]) -> Optional[str]:
    """The status of the first of ``names`` that has a row, or None."""
    for name in names:
        if name in table:
            return table[name][0]
    return None


def _private_default(value: Any) -> bool:
    """A default users cannot pass themselves (Lightning's ``_do_nothing``, ``_DEFAULT`` sentinels)."""
    return getattr(value, "__name__", type(value).__name__).startswith("_")


def _same_default(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 -- objects whose == is not a bool compare by identity
        return a is b


def _callable_of(raw: Any) -> Tuple[Any, bool]:
    """(the function, whether its first parameter is bound: self / cls)."""
    if isinstance(raw, staticmethod):
        return raw.__func__, False
    if isinstance(raw, classmethod):
        return raw.__func__, True
    return raw, True


def signature_problems(path: str, theirs: Any, ours: Any, exempt: Set[str]) -> List[str]:
    """What ``ours`` lacks of ``theirs``' parameters, skipping the parameter names in ``exempt``."""
    (their_fn, their_bound), (our_fn, our_bound) = _callable_of(theirs), _callable_of(ours)
    try:
        their_sig, our_sig = inspect.signature(their_fn), inspect.signature(our_fn)
    except (TypeError, ValueError) as err:
        return [f"{path}: signature unreadable ({type(err).__name__}: {err}); give it a Python signature"]
    their_params = list(their_sig.parameters.values())[1 if their_bound else 0:]
    our_params = list(our_sig.parameters.values())[1 if our_bound else 0:]
    ours_by_name = {p.name: (i, p) for i, p in enumerate(our_params)}
    problems = []
    for index, param in enumerate(their_params):
        if param.name in exempt:
            continue
        where = f"{path}({param.name})"
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            if not any(p.kind is param.kind for p in our_params):
                problems.append(f"{where}: Lightning takes *{param.name}; fabriclite does not")
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            if not any(p.kind is param.kind for p in our_params):
                problems.append(f"{where}: Lightning takes **{param.name}; fabriclite does not")
            continue
        if param.name not in ours_by_name:
            problems.append(f"{where}: missing in fabriclite")
            continue
        our_index, ours_p = ours_by_name[param.name]
        if ours_p.kind is not param.kind:
            problems.append(f"{where}: {param.kind.description} in Lightning, {ours_p.kind.description} in "
                            "fabriclite")
        elif param.kind in _POSITIONAL and our_index != index:
            problems.append(f"{where}: Lightning's positional parameter {index}; fabriclite's is at {our_index}")
        if param.default is _EMPTY:
            continue
        if ours_p.default is _EMPTY:
            problems.append(f"{where}: Lightning's default {param.default!r}; fabriclite's is required")
        elif not _private_default(param.default) and not _same_default(param.default, ours_p.default):
            problems.append(f"{where}: Lightning's default {param.default!r}; fabriclite's {ours_p.default!r}")
    names = {p.name for p in their_params}
    for ours_p in our_params:
        if ours_p.name not in names and ours_p.default is _EMPTY and ours_p.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            problems.append(f"{path}({ours_p.name}): fabriclite requires a parameter Lightning does not have")
    return problems


def only_var_args(fn: Any) -> bool:
    """Whether ``fn`` (a raw class attribute or a function) takes nothing but ``*args`` / ``**kwargs`` (besides
    ``self``): the one case where a row may exempt a whole signature."""
    func, bound = _callable_of(fn)
    try:
        params = list(inspect.signature(func).parameters.values())[1 if bound else 0:]
    except (TypeError, ValueError):
        return False
    return bool(params) and all(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                                for p in params)


def exempt_params(table: Dict[str, Tuple[str, str, str]], paths: List[str]) -> Set[str]:
    """The parameter names that ``Path(param)`` rows exempt, for any of ``paths``."""
    found = set()
    for key in table:
        head, paren, rest = key.partition("(")
        if paren and head in paths:
            found.add(rest.rstrip(")"))
    return found


def _kind(raw: Any) -> str:
    if isinstance(raw, property) or type(raw).__name__ == "cached_property":
        return "property"
    if isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
        return "method"
    return "attribute"


@functools.lru_cache(maxsize=None)
def init_attributes(cls: type) -> Set[str]:
    """The names the ``__init__`` of ``cls`` and its bases assign on ``self`` (``self.x = ...``): a Lightning
    property is matched by an attribute every instance has."""
    found: Set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    found.add(target.attr)
    return found


def _takes_nothing(self: Any) -> None:
    """What ``object.__init__`` takes: a class without its own ``__init__``."""


def _lookup(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if klass is object:
            return _takes_nothing if name == "__init__" else None
        if name in vars(klass):
            return vars(klass)[name]
    return None


def class_problems(prefix: str, cls: type, ours: type, table: Dict[str, Tuple[str, str, str]]) -> List[str]:
    """What fabriclite's ``ours`` lacks of Lightning's class ``cls``: members, kinds, signatures."""
    if not inspect.isclass(ours):
        return [f"{prefix}{cls.__name__}: a class in Lightning, a {type(ours).__name__} in fabriclite"]
    # rows for a member may name the class or any of its public Lightning bases
    bases = [f"{prefix}{k.__name__}" for k in cls.__mro__ if k is not object]
    problems = []
    for name, raw in members(cls):
        paths = [f"{b}.{name}" for b in bases]
        status = row(table, paths)
        if status == "absent":
            continue
        if name == "__init__" and raw is object.__init__:
            continue
        mine = _lookup(ours, name)
        if mine is None and _kind(raw) == "property" and name in init_attributes(ours):
            continue  # an instance attribute set in __init__ reads (and writes) like Lightning's property
        if mine is None:
            problems.append(f"{paths[0]}: missing in fabriclite")
            continue
        if _kind(raw) != _kind(mine) and not (_kind(raw) == "property" and _kind(mine) == "attribute"):
            if status != "different":
                problems.append(f"{paths[0]}: a {_kind(raw)} in Lightning, a {_kind(mine)} in fabriclite")
            continue
        if _kind(raw) == "method":
            if status == "different" and (only_var_args(raw) or only_var_args(mine)):
                continue
            problems += signature_problems(paths[0], raw, mine, exempt_params(table, paths))
    return problems


@functools.lru_cache(maxsize=None)
def canonical_paths() -> Dict[int, Tuple[str, str]]:
    """Lightning object id -> the (module, name) where it first appears in MODULES' order: a class that
    several modules export (``wrappers.Strategy`` is ``strategies.Strategy``) is compared once, there."""
    first: Dict[int, Tuple[str, str]] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in public_names(module_name):
            first.setdefault(id(getattr(module, name)), (module_name, name))
    return first


def name_problems(module_name: str, name: str, table: Dict[str, Tuple[str, str, str]]) -> List[str]:
    """Everything fabriclite lacks of Lightning's public ``module_name.name``, minus the table's rows."""
    prefix = MODULES[module_name]
    path = prefix + name
    theirs = getattr(importlib.import_module(module_name), name)
    home_module, home_name = canonical_paths()[id(theirs)]
    home = MODULES[home_module] + home_name
    status = row(table, [path, home])
    if status == "absent":
        return []
    ours = resolve(module_name, name)
    if ours is None:
        return [f"{path}: missing in fabriclite (no {mirror(module_name)}.{name})"]
    if home != path:  # the same object as at its home path, which is compared there
        mine = resolve(home_module, home_name)
        return [] if ours is mine else [f"{path}: not the same object as fabriclite's {home}"]
    if inspect.isclass(theirs):
        return class_problems(prefix, theirs, ours, table)
    if callable(theirs):
        if not callable(ours):
            return [] if status == "different" else [
                f"{path}: callable in Lightning, a {type(ours).__name__} in fabriclite"]
        if status == "different" and (only_var_args(staticmethod(theirs)) or only_var_args(staticmethod(ours))):
            return []
        # a module-level function has no self: compare from its first parameter
        return signature_problems(path, staticmethod(theirs), staticmethod(ours), exempt_params(table, [path]))
    return []


def lightning_object(path: str) -> Any:
    """The Lightning object a table row names (``strategies.DDPStrategy.barrier``); AttributeError if none."""
    head = path.partition("(")[0]
    parts = head.split(".")
    for module_name, prefix in MODULES.items():
        if prefix and parts[0] == prefix.rstrip("."):
            obj: Any = importlib.import_module(module_name)
            rest = parts[1:]
            break
    else:
        obj, rest = importlib.import_module("lightning.fabric"), parts
    for part in rest:
        obj = getattr(obj, part)
    return obj


def fabriclite_object(path: str) -> Any:
    """fabriclite's object at a row's mirrored path, or None."""
    parts = path.partition("(")[0].split(".")
    for module_name, prefix in MODULES.items():
        if prefix and parts[0] == prefix.rstrip("."):
            try:
                obj: Any = importlib.import_module(mirror(module_name))
            except ImportError:
                return None
            rest = parts[1:]
            break
    else:
        obj, rest = importlib.import_module("fabriclite"), parts
    for part in rest:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _parameters(fn: Any) -> List[str]:
    return list(inspect.signature(fn).parameters)


# ---------------------------------------------------------------------------------------------- the tests
CASES = [(module_name, name) for module_name in MODULES for name in public_names(module_name)]


@pytest.mark.parametrize(("module_name", "name"), CASES, ids=[f"{MODULES[m]}{n}" for m, n in CASES])
def test_public_name_conforms(module_name: str, name: str, table: Dict[str, Tuple[str, str, str]]) -> None:
    """Lightning's public name exists at fabriclite's mirrored path with Lightning's members and parameters,
    or docs/compat.md has a row for the difference."""
    problems = name_problems(module_name, name, table)
    assert not problems, ("fabriclite differs from Lightning where docs/compat.md has no row (fix the API, or add a "
                          "`| Name | Status | Why | Alternative |` row):\n  " + "\n  ".join(problems))


def test_every_module_is_covered() -> None:
    """Each of Lightning's user-facing modules has public names here (a renamed module would hide gaps)."""
    for module_name in MODULES:
        assert public_names(module_name), module_name


def test_table_rows_are_complete(table: Dict[str, Tuple[str, str, str]]) -> None:
    """Every row has a known status, a reason unless it is `same`, and an alternative column."""
    assert len(table) >= 20
    bad = [f"{name}: status {status!r}" for name, (status, _, _) in table.items() if status not in STATUSES]
    bad += [f"{name}: no Why" for name, (status, why, _) in table.items() if not why or why == "—"]
    bad += [f"{name}: no Alternative (write — when none is needed)" for name, (_, _, alt) in table.items() if not alt]
    assert not bad, bad


def test_table_rows_name_lightning_objects(table: Dict[str, Tuple[str, str, str]]) -> None:
    """Every row names a Lightning object (and parameter) that exists, so no row is stale or misspelt."""
    bad = []
    for name in table:
        try:
            obj = lightning_object(name)
        except AttributeError:
            bad.append(f"{name}: no such name in lightning.fabric")
            continue
        if "(" in name:
            param = name.partition("(")[2].rstrip(")")
            target = obj.__init__ if inspect.isclass(obj) else obj
            if param not in _parameters(target):
                bad.append(f"{name}: Lightning's {name.partition('(')[0]} has no parameter {param!r}")
    assert not bad, bad


def test_absent_rows_are_absent(table: Dict[str, Tuple[str, str, str]]) -> None:
    """An `absent` row is true: fabriclite has no such name (or parameter). When one lands, its row goes."""
    bad = []
    for name, (status, _, _) in table.items():
        if status != "absent":
            continue
        ours = fabriclite_object(name)
        if "(" not in name:
            if ours is not None:
                bad.append(f"{name}: fabriclite has it now; drop the row")
        elif ours is not None:
            param = name.partition("(")[2].rstrip(")")
            target = ours.__init__ if inspect.isclass(ours) else ours
            if param in _parameters(target):
                bad.append(f"{name}: fabriclite takes {param!r} now; drop the row")
    assert not bad, bad


def test_present_rows_exist(table: Dict[str, Tuple[str, str, str]]) -> None:
    """A `same` or `different` row names something fabriclite has."""
    bad = [name for name, (status, _, _) in table.items()
           if status != "absent" and "(" not in name and fabriclite_object(name) is None]
    assert not bad, bad


def test_read_table_rejects_malformed_rows() -> None:
    header = "| Name | Status | Why | Alternative |\n|---|---|---|---|\n"
    assert read_table(header + "| `Fabric.launch` | different | why | alt |\n") == {
        "Fabric.launch": ("different", "why", "alt")}
    with pytest.raises(ValueError, match="line 3"):
        read_table(header + "| Fabric.launch | different | why | alt |\n")
    with pytest.raises(ValueError, match="two rows"):
        read_table(header + "| `a` | same | w | — |\n| `a` | same | w | — |\n")


def test_signature_comparison_catches_each_kind_of_gap() -> None:
    """The comparison itself can fail: each kind of difference it must report, on toy functions."""
    def theirs(self, a, b=1, *args, c=2, **kwargs): ...  # noqa: E704
    def same(self, a, b=1, *args, c=2, d=3, **kwargs): ...  # noqa: E704
    def renamed(self, a, bb=1, *args, c=2, **kwargs): ...  # noqa: E704
    def moved(self, b=1, a=None, *args, c=2, **kwargs): ...  # noqa: E704
    def default(self, a, b=2, *args, c=2, **kwargs): ...  # noqa: E704
    def no_var(self, a, b=1, c=2): ...  # noqa: E704
    def extra_required(self, a, b=1, *args, c=2, e, **kwargs): ...  # noqa: E704
    assert signature_problems("f", theirs, same, set()) == []
    assert any("(b): missing" in p for p in signature_problems("f", theirs, renamed, set()))
    assert signature_problems("f", theirs, renamed, {"b"}) == []
    assert any("(a): Lightning's positional parameter 0" in p for p in signature_problems("f", theirs, moved, set()))
    assert any("default 1" in p for p in signature_problems("f", theirs, default, set()))
    assert len(signature_problems("f", theirs, no_var, set())) == 3  # no *args, no **kwargs, c not keyword-only
    assert any("(e): fabriclite requires" in p for p in signature_problems("f", theirs, extra_required, set()))

    def keyword_only(self, *, a, b=1): ...  # noqa: E704
    def positional(self, a, b=1): ...  # noqa: E704
    assert signature_problems("f", keyword_only, positional, set()) == [
        "f(a): keyword-only in Lightning, positional or keyword in fabriclite",
        "f(b): keyword-only in Lightning, positional or keyword in fabriclite"]
    assert signature_problems("f", positional, keyword_only, set())  # and the other way round
    assert any("signature unreadable" in p for p in signature_problems("f", theirs, str.maketrans, set()))

    def var_only(self, *args, **kwargs): ...  # noqa: E704
    assert only_var_args(var_only) and not only_var_args(theirs) and not only_var_args(positional)


def test_a_different_row_exempts_a_signature_only_against_var_args() -> None:
    """A class member whose row is `different` is still compared parameter by parameter, unless one side takes
    nothing but ``*args, **kwargs``; a `different` class row does not exempt its members."""
    class Theirs:
        def step(self, a, b=1): ...  # noqa: E704
        def barrier(self, *args, **kwargs): ...  # noqa: E704

    class Ours:
        def step(self, a, b=2): ...  # noqa: E704
        def barrier(self, name=None): ...  # noqa: E704

    different = {"x.Theirs.step": ("different", "why", "—"), "x.Theirs.barrier": ("different", "why", "—"),
                 "x.Theirs": ("different", "why", "—")}
    assert class_problems("x.", Theirs, Ours, different) == ["x.Theirs.step(b): Lightning's default 1; fabriclite's 2"]
    assert class_problems("x.", Theirs, Ours, {**different, "x.Theirs.step(b)": ("different", "w", "—")}) == []
    assert len(class_problems("x.", Theirs, Ours, {})) == 3  # without rows: the default and both var arguments


if __name__ == "__main__":  # a report of every gap: python tests/unit/compat/test_conformance.py
    rows = read_table(COMPAT_MD.read_text())
    for module_name, public in CASES:
        for problem in name_problems(module_name, public, rows):
            print(problem)
