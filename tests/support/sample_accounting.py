"""Sample accounting for resume tests: which samples each rank loaded, epoch by epoch, across attempts, and the check
that every sample of every epoch was consumed once, apart from the padding that was named.

Inside a rank (a script under test): ``Recorder(directory, attempt, rank)`` appends one line per sample its dataset's
``__getitem__`` loads (``epoch step index``; ``step`` is the optimizer step the sample's batch counts towards), and
``Recorder.attempt_info(...)`` (rank 0) writes the attempt's facts: the step it resumed from, its world size, the
elastic warning it printed. In the test: ``account(directory, length)`` reads every attempt (in the order of their
names), keeps a failed attempt's samples only up to the step the next attempt resumed from, and returns per epoch the
samples consumed; ``check_epochs`` asserts the counts. An attempt's name sorts in the order the attempts ran
(``a0``, ``a1``, ... ; ``a0.r1`` for round 1 of a ``fabriclite run --max-restarts`` job).

Used by tests/integration/checkpoint/test_elastic_resume.py; written to be reused by the engine lanes' tests.
"""
from __future__ import annotations

import collections
import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Counter, Dict, List, Optional, Sequence, Tuple


class Recorder:
    """One rank's log of loaded samples for one attempt (``where()`` gives the current ``(epoch, step)``)."""

    def __init__(self, directory: str, attempt: str, rank: int, where: Callable[[], Tuple[int, int]]) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory, self.attempt, self.rank, self.where = directory, attempt, rank, where
        self._file = open(os.path.join(directory, f"{attempt}.rank{rank}.log"), "a", buffering=1)

    def loaded(self, index: int) -> None:
        epoch, step = self.where()
        self._file.write(f"{epoch} {step} {index}\n")

    def attempt_info(self, resumed_step: int, world_size: int, warnings: Sequence[str]) -> None:
        with open(os.path.join(self.directory, f"{self.attempt}.json"), "w") as f:
            json.dump({"resumed_step": resumed_step, "world_size": world_size, "warnings": list(warnings)}, f)


@dataclass
class Attempt:
    name: str
    resumed_step: int
    world_size: int
    warnings: List[str]
    #: rank -> [(epoch, step, index)] in the order loaded
    records: Dict[int, List[Tuple[int, int, int]]] = field(default_factory=dict)


def read_attempts(directory: str) -> List[Attempt]:
    """Every attempt in ``directory``, in the order of their names."""
    attempts = []
    for name in sorted(f[:-5] for f in os.listdir(directory) if f.endswith(".json")):
        with open(os.path.join(directory, f"{name}.json")) as f:
            info = json.load(f)
        attempt = Attempt(name, info["resumed_step"], info["world_size"], info["warnings"])
        for log in os.listdir(directory):
            found = re.fullmatch(re.escape(name) + r"\.rank(\d+)\.log", log)
            if found:
                with open(os.path.join(directory, log)) as f:
                    attempt.records[int(found.group(1))] = [tuple(int(v) for v in line.split()) for line in f
                                                            if line.strip()]  # type: ignore[misc]
        attempts.append(attempt)
    return attempts


@dataclass
class Accounting:
    attempts: List[Attempt]
    #: epoch -> index -> times consumed (a failed attempt counted up to the step the next one resumed from)
    epochs: Dict[int, Counter[int]]
    #: (attempt name, rank) -> epoch -> the indices consumed in order
    sequences: Dict[Tuple[str, int], Dict[int, List[int]]]
    #: how many records of failed attempts were past the step the next attempt resumed from
    discarded: int


def account(directory: str, any_later: bool = False) -> Accounting:
    """The samples consumed, epoch by epoch, over every attempt (see the module docstring). ``any_later``: cut a
    failed attempt at the earliest step *any* later attempt resumed from, not only the next one (a later attempt
    may resume from an older checkpoint than the one before it, when the newer one turned out damaged)."""
    attempts = read_attempts(directory)
    assert attempts, f"no attempt recorded in {directory}"
    epochs: Dict[int, Counter[int]] = collections.defaultdict(collections.Counter)
    sequences: Dict[Tuple[str, int], Dict[int, List[int]]] = {}
    discarded = 0
    for number, attempt in enumerate(attempts):
        later = [a.resumed_step for a in attempts[number + 1:][:None if any_later else 1]]
        cutoff: Optional[int] = min(later) if later else None
        for rank, records in sorted(attempt.records.items()):
            per_epoch: Dict[int, List[int]] = collections.defaultdict(list)
            for epoch, step, index in records:
                if cutoff is not None and step > cutoff:
                    discarded += 1
                    continue
                epochs[epoch][index] += 1
                per_epoch[epoch].append(index)
            sequences[(attempt.name, rank)] = dict(per_epoch)
    return Accounting(attempts, dict(epochs), sequences, discarded)


def named_repeats(message: str) -> List[int]:
    """The samples an elastic-resume warning names as repeated padding (fabriclite.data.epoch_position)."""
    found = re.search(r"(\d+) repeated as padding(?: \[([\d, ]*)\])?", message)
    assert found, f"no padding named in {message!r}"
    names = [int(v) for v in found.group(2).split(",")] if found.group(2) else []
    assert int(found.group(1)) == len(names), message
    return sorted(names)


def distributed_sampler_shares(length: int, world: int, epoch: int, seed: int, shuffle: bool = True) -> List[List[int]]:
    """Every rank's indices of ``epoch`` as torch's own DistributedSampler deals them (the reference)."""
    from torch.utils.data import DistributedSampler

    shares = []
    for rank in range(world):
        sampler = DistributedSampler(range(length), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


def check_epochs(accounting: Accounting, length: int, epochs: int, padding: Dict[int, List[int]]) -> None:
    """Every epoch below ``epochs`` consumed each of the ``length`` samples once, apart from the repeats
    ``padding[epoch]`` names (a sorted list; every epoch must have an entry), which were consumed exactly once more."""
    assert sorted(accounting.epochs) == list(range(epochs)), sorted(accounting.epochs)
    for epoch in range(epochs):
        counts = accounting.epochs[epoch]
        missing = sorted(set(range(length)) - set(counts))
        assert not missing, f"epoch {epoch}: samples never consumed: {missing}"
        extra = sorted(i for i, c in counts.items() for _ in range(c - 1))
        assert extra == padding[epoch], f"epoch {epoch}: consumed more than once {extra}; the named padding " \
                                        f"{padding[epoch]}"


__all__ = ["Accounting", "Attempt", "Recorder", "account", "check_epochs", "distributed_sampler_shares",
           "named_repeats", "read_attempts"]
