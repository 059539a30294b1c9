"""SLURM hostlist expressions: ``"node[001-003,007],gpu5"`` -> ``["node001", "node002", "node003", "node007", "gpu5"]``.

Grammar (what ``scontrol show hostnames`` accepts): hosts separated by commas or whitespace outside brackets; each
host is literal text with any number of bracket groups ``[a-b,c,...]``. A range ``lo-hi`` is zero-padded to the
width of ``lo`` as written (``[08-10]`` -> 08, 09, 10; ``[8-10]`` -> 8, 9, 10). Several groups in one host expand to
every combination, leftmost slowest (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2).
"""

import itertools
from typing import Iterator, List, Tuple, Union

_Piece = Union[str, Tuple[str, ...]]  # literal text, or the choices of one bracket group


def _split_top_level(text: str) -> List[str]:
    """Split on commas/whitespace that are not inside brackets; checks that brackets balance and do not nest."""
    items: List[str] = []
    current: List[str] = []
    depth = 0
    for char in text:
        if char == "[":
            if depth:
                raise ValueError(f"Hostlist {text!r}: nested '[' is not valid.")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError(f"Hostlist {text!r}: ']' without a matching '['.")
            depth = 0
        elif (char == "," or char.isspace()) and not depth:
            items.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth:
        raise ValueError(f"Hostlist {text!r}: '[' is never closed.")
    items.append("".join(current))
    return items


def _expand_group(group: str, text: str) -> Tuple[str, ...]:
    """The choices inside one bracket group, e.g. ``"001-003,7"`` -> ("001", "002", "003", "7")."""
    choices: List[str] = []
    for part in group.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"Hostlist {text!r}: {part!r} in [{group}] is not a number or a range lo-hi.")
        if not sep:
            choices.append(lo)
            continue
        start, stop = int(lo), int(hi)
        if stop < start:
            raise ValueError(f"Hostlist {text!r}: range {part!r} in [{group}] ends before it starts.")
        choices.extend(str(n).zfill(len(lo)) for n in range(start, stop + 1))
    return tuple(choices)


def _parse_host(item: str, text: str) -> List[_Piece]:
    pieces: List[_Piece] = []
    rest = item
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            pieces.append(rest)
            break
        close_at = rest.index("]", open_at)  # balanced: checked by _split_top_level
        if open_at:
            pieces.append(rest[:open_at])
        pieces.append(_expand_group(rest[open_at + 1 : close_at], text))
        rest = rest[close_at + 1 :]
    return pieces


def iter_hostlist(text: str) -> Iterator[str]:
    """Yield the host names of a SLURM hostlist expression in order; ValueError naming the expression if malformed.

    The whole expression is checked before the first host is yielded.
    """
    items = [item for item in _split_top_level(text.strip()) if item]
    if not items:
        raise ValueError(f"Hostlist {text!r} names no host.")
    parsed = [_parse_host(item, text) for item in items]
    for pieces in parsed:
        choices = [(piece,) if isinstance(piece, str) else piece for piece in pieces]
        for combination in itertools.product(*choices):
            yield "".join(combination)


def expand_hostlist(text: str) -> List[str]:
    """All host names of a SLURM hostlist expression, in order (duplicates kept)."""
    return list(iter_hostlist(text))


def first_host(text: str) -> str:
    """The first host name of a SLURM hostlist expression, without expanding the rest."""
    return next(iter_hostlist(text))
