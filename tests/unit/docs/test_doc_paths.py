"""Every path the docs give a reader exists: each dotted ``fabriclite.…`` name in docs/*.md and README.md imports
(the module, then the attributes after it), and each repository file path (``fabriclite/…``, ``tests/…``,
``benchmarks/…``, ``examples/…``, ``scripts/…``, ``docs/…``) names a file or folder that is there. The names are
read from the docs themselves: no list is kept by hand."""
from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

from helpers import REPO

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
#: a dotted name, not part of a longer word, a file path or a quoted data value ("fabriclite.manifest")
DOTTED = re.compile(r"(?<![\w/.\"'-])fabriclite(?:\.[A-Za-z_]\w*)+")
#: a path inside the repository
FILE = re.compile(r"(?<![\w/.-])((?:fabriclite|tests|benchmarks|examples|scripts|docs|\.ci|mk)/[\w./<>-]*)")


def mentions(pattern: "re.Pattern[str]") -> Iterator[Tuple[str, str]]:
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                yield f"{doc.relative_to(REPO)}:{number}", match.group(1 if pattern.groups else 0)


def resolve(dotted: str) -> Any:
    """The object ``dotted`` names: the longest importable module prefix, then attributes. Raises when missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is not None and not ".".join(parts[:cut]).startswith(err.name):
                raise  # the module exists but imports something missing: a real error
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_docs_name_paths_at_all() -> None:
    """The checks below look at something: the docs do give dotted names and file paths."""
    assert len(list(mentions(DOTTED))) >= 10 and len(list(mentions(FILE))) >= 20


@pytest.mark.parametrize("where,dotted", sorted(set(mentions(DOTTED))))
def test_dotted_name_imports(where: str, dotted: str) -> None:
    try:
        resolve(dotted.rstrip("."))
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{where} names `{dotted}`, which does not import: {err}")


def test_file_paths_exist() -> None:
    missing: List[str] = [f"{where}: {path}" for where, path in mentions(FILE)
                          if "<" not in path and not (REPO / path.rstrip("._,;:")).exists()]
    assert not missing, "the docs name paths that are not in the repository:\n" + "\n".join(missing)
