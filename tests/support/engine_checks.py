"""Checks shared by the engine lanes (tests/integration/engines/lane_*): the logs of tests/support/engine_train.py
read back into attempts, the sample accounting, the final weights against an uninterrupted run's, and the recipes
read out of docs/environments.md.

Accounting rules (issue 27): each sample of each epoch is consumed once, apart from padding that is counted and
named; a failed attempt's steps count only up to the checkpoint the next attempt resumed from.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

from helpers import REPO
from sample_accounting import named_repeats

DOC = REPO / "docs" / "environments.md"

@dataclass
class Attempt:
    """One start of the job: its ranks' logs."""

    id: str
    world: int
    resumed_step: int
    restart_counts: Dict[int, int] = field(default_factory=dict)
    #: rank -> step -> (epoch, indices)
    steps: Dict[int, Dict[int, Tuple[int, List[int]]]] = field(default_factory=dict)
    done: Dict[int, int] = field(default_factory=dict)
    killed: List[int] = field(default_factory=list)
    #: rank -> the warnings load_latest gave; rank -> whether the process group existed before fabric.launch()
    warnings: Dict[int, List[str]] = field(default_factory=dict)
    group_before_launch: Dict[int, bool] = field(default_factory=dict)
    #: rank -> its start record (process_start, t: after load_latest, ...) and the time of each step it logged
    heads: Dict[int, dict] = field(default_factory=dict)
    step_times: Dict[int, Dict[int, float]] = field(default_factory=dict)
    killed_at: List[float] = field(default_factory=list)

    @property
    def started_ns(self) -> int:
        return int(self.id.split("-")[0])


def read_attempts(log_dir: Path) -> List[Attempt]:
    """Every attempt that logged, in the order they started."""
    attempts: Dict[str, Attempt] = {}
    for path in sorted(Path(log_dir).glob("log-*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        head = records[0]
        attempt = attempts.setdefault(head["start"], Attempt(head["start"], head["world"], head["resumed_step"]))
        assert (attempt.world, attempt.resumed_step) == (head["world"], head["resumed_step"]), \
            f"the ranks of attempt {head['start']} disagree on the world size or the step they resumed: {head}"
        rank = head["rank"]
        attempt.restart_counts[rank] = head["restart_count"]
        attempt.warnings[rank] = head.get("warnings", [])
        attempt.group_before_launch[rank] = head.get("group_before_launch", False)
        attempt.heads[rank] = head
        attempt.step_times[rank] = {r["step"]: r["t"] for r in records if "step" in r}
        attempt.killed_at += [r["t"] for r in records if "killed" in r]
        attempt.steps[rank] = {r["step"]: (r["epoch"], r["indices"]) for r in records if "step" in r}
        attempt.done.update({rank: r["done"] for r in records if "done" in r})
        attempt.killed += [r["killed"] for r in records if "killed" in r]
    return sorted(attempts.values(), key=lambda a: a.started_ns)


def accounting(attempts: Sequence[Attempt], n: int, steps: int) -> Dict[str, object]:
    """Check the samples the job trained on, and return what was found: ``{"epochs": {epoch: padding}, "kept":
    [(attempt world, first step, last step)], "padding": {epoch: [repeated indices]}}``.

    The kept steps: attempt i's steps after the step it resumed from, up to the step attempt i+1 resumed from
    (the last attempt's up to ``steps``). Each kept step must be logged by every rank of its attempt. Per epoch,
    every index of range(n) is consumed at least once; the repeats are the padding, at most (world size - 1)
    of the largest world the epoch ran at, and exactly what DistributedSampler pads when one world ran it all."""
    assert attempts, "no attempt logged anything"
    assert attempts[0].resumed_step == 0, f"the first attempt resumed from step {attempts[0].resumed_step}, not 0"
    per_epoch: Dict[int, Counter] = {}
    worlds: Dict[int, set] = {}
    kept = []
    for i, attempt in enumerate(attempts):
        end = attempts[i + 1].resumed_step if i + 1 < len(attempts) else steps
        assert end >= attempt.resumed_step, \
            f"attempt {i + 1} resumed from step {end}, before attempt {i} started (step {attempt.resumed_step})"
        assert sorted(attempt.steps) == list(range(attempt.world)), \
            f"attempt {i} (world {attempt.world}) has logs of ranks {sorted(attempt.steps)}"
        for step in range(attempt.resumed_step + 1, end + 1):
            epochs = set()
            for rank, logged in attempt.steps.items():
                assert step in logged, (f"attempt {i} rank {rank} never logged step {step}, yet the next attempt "
                                        f"resumed from step {end}")
                epoch, indices = logged[step]
                epochs.add(epoch)
                per_epoch.setdefault(epoch, Counter()).update(indices)
                worlds.setdefault(epoch, set()).add(attempt.world)
            assert len(epochs) == 1, f"the ranks of attempt {i} ran step {step} in different epochs: {epochs}"
        if end > attempt.resumed_step:
            kept.append((attempt.world, attempt.resumed_step + 1, end))
    last = attempts[-1]
    assert last.done and set(last.done.values()) == {steps} and len(last.done) == last.world, \
        f"the last attempt did not finish at step {steps} on every rank: {last.done}"
    padding: Dict[int, List[int]] = {}
    final_epoch = max(per_epoch)
    for epoch, counts in sorted(per_epoch.items()):
        missing = [i for i in range(n) if counts[i] == 0]
        if epoch == final_epoch and missing:
            continue  # the run stopped inside this epoch (STEPS is not a whole number of epochs)
        assert not missing, f"epoch {epoch}: samples {missing} were never consumed"
        outside = set(counts) - set(range(n))
        assert not outside, f"epoch {epoch}: indices outside the dataset: {outside}"
        repeats = sorted(i for i, c in counts.items() for _ in range(c - 1))
        padding[epoch] = repeats
        if len(worlds[epoch]) == 1:
            (world,) = worlds[epoch]
            assert len(repeats) == world * math.ceil(n / world) - n, \
                f"epoch {epoch} at world size {world}: {len(repeats)} repeated samples {repeats}, expected " \
                f"DistributedSampler's padding of {world * math.ceil(n / world) - n}"
        else:  # resumed at another world size inside this epoch: the rest is padded as the warning names
            named = elastic_padding(attempts, epoch)
            assert repeats == named, \
                f"epoch {epoch} ran at world sizes {sorted(worlds[epoch])}: samples {repeats} were consumed twice; " \
                f"the elastic resume's warning named {named} as padding"
            assert len(repeats) <= max(worlds[epoch]) - 1
    return {"padding": padding, "kept": kept, "worlds": {e: sorted(w) for e, w in worlds.items()}}


def recovery_parts(attempts: Sequence[Attempt]) -> Dict[str, float]:
    """The parts of the recovery from the first attempt's failure (a worker's SIGKILL, else its last logged step)
    to the next attempt training again, in seconds: the failure until the first new worker process started, the
    new workers' start until every rank had resumed (imports, launch, setup, load_latest), then until every rank
    finished its first step. Their sum is failure -> training again."""
    first, second = attempts[0], attempts[1]
    failed = min(first.killed_at) if first.killed_at else max(max(t.values()) for t in first.step_times.values() if t)
    started = min(h["process_start"] for h in second.heads.values())
    resumed = max(h["t"] for h in second.heads.values())
    stepped = max(min(t.values()) for t in second.step_times.values())
    return {"failure -> new workers start": started - failed, "workers start -> resumed": resumed - started,
            "resumed -> first step done": stepped - resumed}


def elastic_padding(attempts: Sequence[Attempt], epoch: int) -> List[int]:
    """The repeats named by the elastic-resume warning of the attempt that resumed inside ``epoch`` (rank 0's)."""
    for attempt in attempts:
        for message in attempt.warnings.get(0, []):
            if "repeated as padding" in message and f"epoch {epoch}" in message:
                return named_repeats(message)
    raise AssertionError(f"no attempt warned about an elastic resume inside epoch {epoch}: "
                         f"{[a.warnings.get(0) for a in attempts]}")


def steps_per_epoch(n: int, world: int, batch: int) -> int:
    """Batches per rank in one epoch (DistributedSampler pads to a multiple of ``world``; drop_last=False)."""
    return math.ceil(math.ceil(n / world) / batch)


def load_weights(path: Path) -> List[torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bit_identical(resumed: Path, uninterrupted: Path) -> None:
    """The final parameters of two runs equal bit for bit (same dtype and shape, every bit)."""
    a, b = load_weights(resumed), load_weights(uninterrupted)
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        same = torch.equal(x.view(torch.int32), y.view(torch.int32)) if x.dtype == torch.float32 else torch.equal(x, y)
        assert same, (f"parameter {k} differs from the uninterrupted run's: max |diff| "
                      f"{(x.double() - y.double()).abs().max().item():.3e}, sums {x.sum().item():.10f} against "
                      f"{y.sum().item():.10f}")


def assert_finite(path: Path) -> None:
    for k, p in enumerate(load_weights(path)):
        assert torch.isfinite(p).all(), f"parameter {k} of {path} is not finite"


def recipe(name: str) -> str:
    """The code block docs/environments.md marks ``<!-- recipe: NAME -->`` (the line before its opening fence)."""
    text = DOC.read_text()
    match = re.search(rf"<!-- recipe: {re.escape(name)} -->\n```[a-z]*\n(.*?)\n```", text, re.S)
    assert match, f"docs/environments.md has no code block marked <!-- recipe: {name} -->"
    return match.group(1)


def substitute(text: str, replacements: Dict[str, str]) -> str:
    """``text`` with each key replaced by its value; each key must occur (else the recipe changed under the test)."""
    for old, new in replacements.items():
        assert old in text, f"the recipe no longer contains {old!r}; update the test that runs it:\n{text}"
        text = text.replace(old, new)
    return text


#: the torchrun lane's rendezvous settings (seconds): the last call after the minimum of nodes joined, and how long
#: a rendezvous may take at all (the default 600 s would hide a hang); a test speed-up torchrun allows
TORCHRUN_RDZV_CONF = "join_timeout=90,last_call_timeout=2,close_timeout=10"
ENGINE_TRAIN = REPO / "tests" / "support" / "engine_train.py"


def torchrun_agents(tmp: Path, env: Dict[str, str], port: int, count: int = 3,
                    python: str = sys.executable) -> List[subprocess.Popen]:
    """``count`` torchrun agents on this machine, each the recipe of docs/environments.md (``<!-- recipe: torchrun
    -->``) with the interpreter, ``port``, the training script and ``tmp/ckpt`` substituted and short rendezvous
    timeouts added; agent 0 hosts the rendezvous (``is_host``) and starts first. Each agent runs in a session of its
    own; its log is ``tmp/agent<i>.log``. ``env`` needs HEAD_NODE and JOB_ID (the recipe's variables)."""
    agents = []
    for i in range(count):
        command = substitute(recipe("torchrun"), {
            "torchrun ": f"{python} -m torch.distributed.run --rdzv-conf "
                         f"is_host={'true' if i == 0 else 'false'},{TORCHRUN_RDZV_CONF} ",
            "29400": str(port), "train.py": str(ENGINE_TRAIN), "/shared/ckpt": str(tmp / "ckpt")})
        with open(tmp / f"agent{i}.log", "w") as log:
            agents.append(subprocess.Popen(["bash", "-c", command], env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        if i == 0:
            time.sleep(1.0)  # the host's store listens before the others connect (they would retry anyway)
    return agents


def descendants(root: int) -> List[int]:
    """The processes below ``root`` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid]
        found += children
        frontier += children
    return found


def kill_tree(root: int) -> None:
    """SIGKILL ``root``'s session and every process below it (torchrun starts each worker in a session of its own)."""
    below = descendants(root)
    for kill in [lambda: os.killpg(root, signal.SIGKILL)] + [lambda pid=pid: os.kill(pid, signal.SIGKILL)
                                                              for pid in below]:
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
