"""What the SLURM lane's tests share: the recipes read out of docs/environments.md, one job's folders and
environment, and the sample accounting the training job logs (tests/integration/engines/lane_slurm/slurm_train.py).
"""
from __future__ import annotations

import collections
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs", "environments.md")
TRAIN = os.path.join(REPO, "tests", "integration", "engines", "lane_slurm", "slurm_train.py")


def recipe(name: str) -> str:
    """The code block that follows ``<!-- recipe: NAME -->`` in docs/environments.md (KeyError naming it)."""
    with open(DOCS) as f:
        text = f.read()
    match = re.search(rf"<!-- recipe: {re.escape(name)} -->\s*```\w*\n(.*?)```", text, re.S)
    if match is None:
        raise KeyError(f"docs/environments.md has no block marked <!-- recipe: {name} -->")
    return match.group(1)


def substitute(text: str, replacements: Dict[str, str]) -> str:
    """``text`` with each key replaced; AssertionError when a key is not in the recipe (the docs changed)."""
    for old, new in replacements.items():
        assert old in text, f"the recipe no longer contains {old!r}:\n{text}"
        text = text.replace(old, new)
    return text


@dataclass
class JobFiles:
    """One training job's folders (checkpoints, accounting, output) and the environment it is submitted with."""

    root: str
    extra: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for sub in ("ckpt", "account"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)

    @property
    def ckpt(self) -> str:
        return os.path.join(self.root, "ckpt")

    @property
    def account(self) -> str:
        return os.path.join(self.root, "account")

    @property
    def out(self) -> str:
        return os.path.join(self.root, "weights.pt")

    def output(self, job: str = "*") -> str:
        """The job's output (sbatch --output), all attempts (--open-mode=append)."""
        import glob

        return "".join(open(p, errors="replace").read() for p in sorted(glob.glob(os.path.join(self.root, f"job-{job}.out"))))

    def env(self, **extra: str) -> Dict[str, str]:
        venv_bin = os.path.dirname(sys.executable)
        return {"PYTHONPATH": REPO, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
                "CKPT_DIR": self.ckpt, "ACCOUNT_DIR": self.account, "OUT": self.out, "OMP_NUM_THREADS": "1",
                "FABRICLITE_TIMEOUT": "120", **self.extra, **extra}

    def weights(self, name: Optional[str] = None) -> List[torch.Tensor]:
        return torch.load(os.path.join(self.root, name) if name else self.out)

    def waiting(self, sub: str = "") -> bool:
        """Whether rank 0 waits for the test's signal (WAIT_AT)."""
        return os.path.exists(os.path.join(self.account, sub, "waiting"))

    def progress(self, sub: str = "") -> int:
        """The last step rank 0 finished (0 before the first)."""
        path = os.path.join(self.account, sub, "progress")
        try:
            with open(path) as f:
                return int(f.read().split()[-1])
        except (OSError, ValueError, IndexError):
            return 0


def same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@dataclass
class Attempt:
    key: Tuple[int, int, int]  # (job id, SLURM_RESTART_COUNT, fabriclite round)
    restart_count: int
    resumed: int
    world: int


def attempts(account: str) -> List[Attempt]:
    """Rank 0's line per attempt (attempts.log), in the order they ran."""
    found = []
    with open(os.path.join(account, "attempts.log")) as f:
        for line in f:
            job, slurm, rnd, *rest = line.split()
            values = dict(item.split("=") for item in rest)
            found.append(Attempt((int(job.split("_")[0]), int(slurm), int(rnd)), int(values["restart_count"]),
                                 int(values["resumed"]), int(values["world"])))
    return found


def accounting(account: str, steps: int) -> Dict[int, collections.Counter]:
    """The samples each epoch consumed, counted, from every attempt's ``__getitem__`` log: an attempt's steps
    count only up to the step the next attempt resumed from (later ones were redone); a batch loaded for a step
    that did not finish does not count. Checks on the way that every step 1..steps finished exactly once per
    rank of the attempt that kept it. Returns {epoch: Counter(sample index -> times consumed)}."""
    import glob

    per_attempt: Dict[Tuple[int, int, int], Dict[int, List[str]]] = collections.defaultdict(dict)
    for path in glob.glob(os.path.join(account, "samples-*.log")):
        job, slurm, rnd, rank = os.path.basename(path)[len("samples-"):-len(".log")].split("-")
        with open(path) as f:
            per_attempt[(int(job.split("_")[0]), int(slurm), int(rnd))][int(rank)] = f.read().splitlines()
    order = sorted(per_attempt)
    resumed_at = {}
    for key in order:
        first = per_attempt[key][0][0]
        assert first.startswith("attempt resumed="), first
        resumed_at[key] = int(first.split()[1].split("=")[1])
    epochs: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    finished_steps: List[int] = []
    for i, key in enumerate(order):
        keep_until = resumed_at[order[i + 1]] if i + 1 < len(order) else steps
        for rank, lines in sorted(per_attempt[key].items()):
            pending: List[int] = []
            for line in lines[1:]:
                if line.startswith("step "):
                    _, n, _, epoch = line.split()
                    if int(n) <= keep_until:
                        epochs[int(epoch)].update(pending)
                        if rank == 0:
                            finished_steps.append(int(n))
                    pending = []
                elif not line.startswith("attempt"):
                    pending.append(int(line))
    assert finished_steps == list(range(1, steps + 1)), f"steps kept: {finished_steps}"
    return dict(epochs)


def check_epochs(epochs: Dict[int, collections.Counter], samples: int, padding: int = 0,
                 last_full: bool = True) -> None:
    """Every epoch consumed each of ``samples`` once, apart from at most ``padding`` repeats per epoch (named in
    the message); the last epoch may be partial (``last_full=False``): none missing is then not required."""
    last = max(epochs)
    for epoch, counts in sorted(epochs.items()):
        repeats = {i: c - 1 for i, c in counts.items() if c > 1}
        assert sum(repeats.values()) <= padding, f"epoch {epoch}: samples consumed more than once: {repeats}"
        assert set(counts) <= set(range(samples)), f"epoch {epoch}: unknown samples {set(counts) - set(range(samples))}"
        if epoch != last or last_full:
            missing = set(range(samples)) - set(counts)
            assert not missing, f"epoch {epoch}: samples never consumed: {sorted(missing)}"
