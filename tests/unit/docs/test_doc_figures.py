"""Every measured number in the docs comes from a recorded run: each ratio (``1.23x``, ``1.23×``) in docs/*.md
and README.md, and each time, size or rate written in a table row or in a sentence that compares (faster,
slower, than, against, vs, ...), appears in one of the results files the benchmarks write
(``benchmarks/results/*.md``: command, date, machine and torch version above the tables). The figures and
the results are read from the files themselves, so a new benchmark's table is checked the same way once its
results file is there.

Design constants are not measurements and are written as settings: a figure right after a setting word
("polls every 50 ms", "timeout 5 s", "default 20 s", "a 3 s grace", "--max-restarts 1", "up to 30 s") is not
checked; nor is anything in code (fenced blocks, `inline code`) or in double quotes, which show commands
and messages."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

from helpers import REPO

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
RESULTS = REPO / "benchmarks" / "results"

#: a number with a unit of time, size or rate; or a ratio written as 1.23x / 1.23× (not 8x32, not 2x2)
NUMBER = r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?"
TIME = r"(?:ns|us|µs|ms|s|sec|min|h)"
SIZE = r"(?:B|KB|KiB|MB|MiB|GB|GiB|TB|TiB)"
RATE = r"(?:steps/s|it/s|samples/s|tokens/s|GB/s|MB/s|/s)"
FIGURE = re.compile(rf"{NUMBER}(?:\s?(?:{RATE}|{TIME}|{SIZE})(?![\w/])|(?:x|×)(?![\w×]))")
RATIO = re.compile(r"(?:x|×)$")
#: a sentence that compares two things (as does one with a ratio in it)
COMPARES = re.compile(r"\b(?:faster|slower|than|against|vs\.?|versus|compared|ratio|speed-?up|overhead|"
                      r"as fast|as slow|saves?|savings?|smaller|larger|more|less|fewer|below|above|within)\b",
                      re.IGNORECASE)
#: words after which a figure is a setting (an interval, a timeout, a budget, a default, a bound a test asserts)
SETTING = re.compile(r"(?:\bevery|\bdefault:?|\btimeout:?|\bgrace(?: of| period)?:?|\bbackoff:?|\bbudget(?: of)?:?|"
                     r"\bat most|\bup to|\bat least|\bafter|\bwaits?(?: up to)?|\bpolls?(?: every)?|\binterval|"
                     r"\bdeadline|\bbound(?: of)?|\blimit(?: of)?|\bcap(?: of)?|\bfor|\ba|\bthe|\bto|"
                     r"\b(?:≤|<=|<|>=|≥|=)|--[\w-]+(?:[ =])?)\s*$", re.IGNORECASE)
#: code spans and quoted output ("... within 4 s"): what a program prints, not a claim about it
CODE = re.compile(r"`[^`]*`|\"[^\"]*\"")


def _sentences(text: str) -> Iterator[Tuple[int, str, bool]]:
    """(line number, sentence or table row, is a table row) of ``text``, code left out."""
    fenced = False
    para: List[Tuple[int, str]] = []

    def flush() -> Iterator[Tuple[int, str, bool]]:
        if para:
            joined = " ".join(line for _, line in para)
            starts = [0] + [m.end() for m in re.finditer(r"(?<=[.;:!?])\s+(?=[A-Z(*\"-])", joined)]
            for a, b in zip(starts, starts[1:] + [len(joined)]):
                yield para[0][0], joined[a:b], False
            para.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = CODE.sub(" ", line)
        if line.lstrip().startswith("|"):
            yield from flush()
            yield number, line, True
        elif not line.strip() or line.lstrip().startswith(("#", "- ", "* ", "<!--")):
            yield from flush()
            if line.strip() and not line.lstrip().startswith(("#", "<!--")):
                para.append((number, line.lstrip()[2:]))
        else:
            para.append((number, line))
    yield from flush()


def _normal(figure: str) -> str:
    """One spelling of a figure: no thousands commas, no space before the unit, x for ×, µs as us."""
    return re.sub(r"\s+", "", figure).replace(",", "").replace("×", "x").replace("µs", "us").lstrip("+")


def measured(name: str, text: str) -> Iterator[Tuple[str, str]]:
    """(where, figure) for each figure in ``text`` (the file ``name``) that is a measurement by the rules above."""
    for number, sentence, row in _sentences(text):
        figures = list(FIGURE.finditer(sentence))
        compares = row or COMPARES.search(sentence) or any(RATIO.search(m.group(0)) for m in figures)
        for match in figures:
            figure = match.group(0)
            if SETTING.search(sentence[:match.start()]):
                continue
            if compares:
                yield f"{name}:{number}", figure


def recorded() -> Set[str]:
    """Every figure written in a results file, in its normal spelling."""
    found: Set[str] = set()
    for path in sorted(RESULTS.glob("**/*.md")):
        for match in FIGURE.finditer(path.read_text()):
            found.add(_normal(match.group(0)))
    return found


def test_the_rules_see_figures() -> None:
    """The scanner finds what it should and leaves settings and code alone (a check of the check)."""
    text = ("fabriclite took 4.25 ms, 1.23x floor (a).\nThe supervisor polls every 50 ms.\n"
            "| case | time |\n|---|---|\n| launch | 3.72 s |\n`sleep 5 s` prints 7 s faster.\n\n```\n9.9x\n```\n")
    found = [figure for _, figure in measured("probe.md", text)]
    assert found == ["4.25 ms", "1.23x", "3.72 s", "7 s"], found


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_measured_figure_comes_from_a_results_file(doc: Path) -> None:
    have = recorded()
    missing = [f"{where}: {figure}" for where, figure in measured(str(doc.relative_to(REPO)), doc.read_text())
               if _normal(figure) not in have]
    assert not missing, ("measured figures in the docs that no benchmarks/results/*.md file holds (rerun the "
                         "benchmark that measures them and quote its file, or write a design constant as a "
                         "setting):\n" + "\n".join(missing))
