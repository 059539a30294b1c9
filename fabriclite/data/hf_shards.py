"""Dealing the shards of a Hugging Face ``datasets.IterableDataset`` over ranks and workers, so that an epoch's rest
can be dealt again over another number of ranks or workers, every shard resumed at its recorded offset.

A dataset split with ``split_dataset_by_node(ds, rank, world_size)`` (fabriclite reads the split from the private
``ds._distributed``: ``stream_kinds.DATASETS_VERSIONS`` lists the supported versions) is iterated by fabriclite,
one shard at a time (``ds.shard(num_shards=n, index=s)`` of the unsplit dataset), the way ``datasets`` deals it:

- a plain epoch: when the ``n`` shards divide by the world size ``W``, rank ``r`` gets shards ``r, r + W, ...``, else
  every rank reads all shards and keeps every ``W``-th example from ``r`` on (``split_dataset_by_node``'s split by
  examples); worker ``w`` of ``nw`` takes every ``nw``-th of the rank's shards from ``w`` on. The order is the
  shards' own in every epoch (``datasets`` would permute the shards after ``set_epoch``; fabriclite keeps them in
  order, so that a position means the same in every epoch).
- a resumed epoch at other sizes (:func:`deal`): the shards not finished, each at its offset, are dealt the same way
  over this run's ranks and workers (shard ``k`` of the rest to rank ``k % W'``, worker ``(k // W') % nw'``); each
  shard resumes through its own ``state_dict`` (``datasets`` re-reads the current shard up to its offset).

A worker's snapshot (``ShardStream.snapshot``, taken after each batch by ``worker_snapshots.SnapshotStream``) holds its
shards left (the current one with its Hugging Face state) and its place in its stream. :func:`rest` merges every
rank's and worker's snapshots into the shards left of the epoch: ranks that share a stream (the split by examples)
must each have consumed the same number of examples from it, give or take the first ranks one more (they do when
they consumed the same number of batches); else a StreamPositionError.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from fabriclite.data.stream_kinds import StreamPositionError

#: a shard of a stream: [shard index, examples of it passed, its Hugging Face state (None: from its start)]
Entry = List[Any]


def plain_plan(shards: int, rank: int, world_size: int, worker: int, workers: int) -> Dict[str, Any]:
    """Worker ``worker``'s stream in a plain epoch (see the module docstring): ``{"entries", "step", "offset"}``."""
    if shards % world_size == 0:
        mine, step, offset = list(range(rank, shards, world_size)), 1, 0
    else:
        mine, step, offset = list(range(shards)), world_size, rank
    return {"entries": [[s, 0, None] for s in mine[worker::max(1, workers)]], "step": step, "offset": offset}


def deal(rest: List[Entry], world_size: int, workers: int) -> List[Dict[int, Dict[str, Any]]]:
    """The shards left ``rest`` (in shard order) dealt over ``world_size`` ranks x ``workers`` workers: per rank,
    worker -> ``{"entries", "step": 1, "offset": 0}``."""
    workers = max(1, workers)
    plans: List[Dict[int, Dict[str, Any]]] = [{w: {"entries": [], "step": 1, "offset": 0} for w in range(workers)}
                                              for _ in range(world_size)]
    for k, entry in enumerate(sorted(rest, key=lambda e: e[0])):
        plans[k % world_size][(k // world_size) % workers]["entries"].append(list(entry))
    return plans


class ShardDealer:
    """The source of a ``worker_snapshots.SnapshotStream`` over the Hugging Face ``dataset`` (split by node) for
    ``rank``: each worker's stream of shards, from ``plan`` (worker -> stream; None: the plain epoch's dealing)."""

    def __init__(self, dataset: Any, rank: int, world_size: int,
                 plan: Optional[Mapping[int, Dict[str, Any]]] = None) -> None:
        base = copy.copy(dataset)
        base.__dict__ = dict(dataset.__dict__)  # datasets' copy shares its __dict__ with the original
        base._distributed = None  # fabriclite deals the shards itself (the user's dataset keeps its split)
        self.base, self.shards = base, int(dataset._ex_iterable.num_shards)
        self.rank, self.world_size = rank, world_size
        self.plan = {int(w): p for w, p in plan.items()} if plan is not None else None

    def worker_plan(self, worker: int, workers: int) -> Dict[str, Any]:
        if self.plan is not None:
            return copy.deepcopy(self.plan.get(worker, {"entries": [], "step": 1, "offset": 0}))
        return plain_plan(self.shards, self.rank, self.world_size, worker, workers)

    def stream(self, worker: int, workers: int, resume: Optional[Dict[str, Any]]) -> "ShardStream":
        start = copy.deepcopy(resume) if resume is not None else {**self.worker_plan(worker, workers), "position": 0,
                                                                    "kept": 0, "done": []}
        return ShardStream(self.base, self.shards, start)


class ShardStream:
    """One worker's stream: its shards in order, each from its recorded place; every ``step``-th example from
    ``offset`` on (counted over the whole stream) is this rank's."""

    def __init__(self, base: Any, shards: int, start: Dict[str, Any]) -> None:
        self.base, self.shards = base, shards
        self.entries: List[Entry] = [list(e) for e in start["entries"]]
        self.step, self.offset = int(start["step"]), int(start["offset"])
        self.position, self.kept, self.done = int(start.get("position", 0)), int(start.get("kept", 0)), \
            list(start.get("done", []))
        self._current: Any = None

    def __iter__(self) -> Iterator[Any]:
        while self.entries:
            shard, passed, state = self.entries[0]
            sub = self.base.shard(num_shards=self.shards, index=int(shard), contiguous=True)
            if state is not None:
                state = copy.deepcopy(state)
                state["epoch"] = sub.epoch  # datasets applies a state only in the epoch it was taken in
                sub.load_state_dict(state)
            self._current = sub
            for example in _examples(sub):
                self.entries[0][1] += 1
                self.position += 1
                if (self.position - 1) % self.step == self.offset:
                    self.kept += 1
                    yield example
            self.done.append(int(shard))
            self.entries.pop(0)
            self._current = None

    def snapshot(self) -> Dict[str, Any]:
        entries = [list(e) for e in self.entries]
        if entries and self._current is not None:
            entries[0][2] = self._current.state_dict()
        return {"entries": entries, "step": self.step, "offset": self.offset, "position": self.position,
                "kept": self.kept, "done": list(self.done)}


def _examples(dataset: Any) -> Iterator[Any]:
    """The examples of a Hugging Face IterableDataset as its ``__iter__`` yields them in the main process: in a
    DataLoader worker ``__iter__`` would split the (one) shard again over the workers (datasets 5.2's own code)."""
    from datasets.formatting import get_formatter

    ex_iterable = dataset._prepare_ex_iterable_for_iteration()
    if dataset._formatting and (ex_iterable.iter_arrow or dataset._formatting.is_table):
        formatter = get_formatter(dataset._formatting.format_type, features=dataset.features)
        for _, table in ex_iterable.iter_arrow():
            yield formatter.format_row(table)
        return
    for _, example in ex_iterable:
        yield example


def _stream_key(plan: Mapping[str, Any]) -> Tuple[str, int]:
    return json.dumps([e[0] for e in plan["entries"]]), int(plan["step"])


def rest(rank_states: List[Mapping[str, Any]], where: str) -> List[Entry]:
    """The shards of the epoch left after every rank's and worker's consumed batches (see the module docstring):
    ``rank_states[r]`` holds ``"plans"`` (worker -> its stream at the epoch's start) and ``"workers"`` (worker -> the
    tag of its last consumed batch). ``where`` names the position for the error."""
    streams: Dict[Tuple[str, int], List[Tuple[int, Dict[str, Any]]]] = {}
    for rank, rank_state in enumerate(rank_states):
        tags = {int(w): t for w, t in rank_state.get("workers", {}).items()}
        for worker, plan in rank_state["plans"].items():
            tag = tags.get(int(worker))
            now = tag["state"] if tag is not None else {**plan, "position": 0, "kept": 0, "done": []}
            streams.setdefault(_stream_key(plan), []).append((int(plan["offset"]), now))
    left: Dict[int, Entry] = {}
    for (_, step), sharing in streams.items():
        sharing.sort(key=lambda s: s[0])
        if len(sharing) != step:
            raise StreamPositionError(f"{where}: a stream read by {step} ranks was recorded by {len(sharing)}; the "
                                      "saved position is damaged.")
        kept = [s[1]["kept"] for s in sharing]
        low = min(kept)
        if max(kept) - low > 1 or any(a < b for a, b in zip(kept, kept[1:])):
            raise StreamPositionError(
                f"{where}: the ranks that share a stream of shards (split_dataset_by_node splits by examples when the "
                f"shards do not divide by the world size) consumed {kept} examples of it, so what they consumed "
                "together is not a prefix of the stream; its shards cannot be dealt again. Resume at the saved world "
                "size and number of workers.")
        furthest = max((s[1] for s in sharing), key=lambda now: now["position"])
        for entry in furthest["entries"]:
            left[int(entry[0])] = list(entry)
    return [left[s] for s in sorted(left)]


__all__ = ["ShardDealer", "ShardStream", "deal", "plain_plan", "rest"]
