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
- a resumed epoch at other sizes (:func:`deal`): the shards not finished, each at its offset, are dealt by examples
  over this run's ranks and workers (every ``W'``-th example of the merged rest from rank ``r`` on, its ``k``-th to
  worker ``k % nw'``; each worker reads the whole rest), ranks short by one example padded with their first, at most
  W' - 1 padding samples over the job; each shard resumes through its own ``state_dict`` (``datasets`` re-reads the
  current shard up to its offset). A dealt epoch's position moves again only to its own sizes (its workers' shares
  interleave: what they consumed is not a prefix of the rest).

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
    """The shards left ``rest`` (in shard order) dealt over ``world_size`` ranks x ``workers`` workers by examples:
    per rank, worker -> its stream. Every worker reads the whole rest, each shard from its offset, and keeps the
    examples at the positions ``p`` with ``p % W' == rank`` and ``(p // W') % workers == worker``: rank ``r`` gets
    every ``W'``-th example of the rest from ``r`` on, and its ``k``-th goes to worker ``k % workers``. A rank with
    one example fewer than rank 0 repeats its first example as padding, in the worker its next example would have
    gone to, so that every rank's workers hold the same numbers of examples (the same batches): at most W' - 1
    padding samples over the job, as ``DistributedSampler`` pads (``"pad"``; the stream counts the rest as it reads
    it, so nothing is read twice but that example)."""
    workers = max(1, workers)
    entries = [list(e) for e in sorted(rest, key=lambda e: e[0])]
    return [{w: {"entries": copy.deepcopy(entries), "step": world_size * workers, "offset": w * world_size + r,
                 "pad": {"ranks": world_size, "rank": r, "workers": workers, "worker": w,
                         "origin": copy.deepcopy(entries)}}
             for w in range(workers)} for r in range(world_size)]


def padding_due(plan_pad: Mapping[str, Any], total: int) -> bool:
    """Whether the worker of ``plan_pad`` (:func:`deal`'s ``"pad"``) repeats its rank's first example, the rest
    holding ``total`` examples: its rank has one fewer than rank 0 and its next example was this worker's."""
    ranks, rank, workers, worker = (int(plan_pad[k]) for k in ("ranks", "rank", "workers", "worker"))
    most = -(-total // ranks)
    mine = -(-(total - rank) // ranks) if total > rank else 0
    return mine < most and (most - 1) % workers == worker


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
        self.pad: Optional[Dict[str, Any]] = start.get("pad")
        self.padded = int(start.get("padded", 0))
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
        if self.pad is not None and not self.padded and padding_due(self.pad, self.position):
            mine = int(self.pad["rank"])  # its rank's first example; the rest's first when the rank has none
            example = self._example_at(mine if mine < self.position else 0)
            if example is not None:
                self.padded = 1
                yield example

    def _example_at(self, position: int) -> Any:
        """The rest's example at ``position`` (its rank's first), read again from the rest's start."""
        assert self.pad is not None
        seen = 0
        for shard, _, state in self.pad["origin"]:
            sub = self.base.shard(num_shards=self.shards, index=int(shard), contiguous=True)
            if state is not None:
                state = copy.deepcopy(state)
                state["epoch"] = sub.epoch
                sub.load_state_dict(state)
            for example in _examples(sub):
                if seen == position:
                    return example
                seen += 1
        return None

    def snapshot(self) -> Dict[str, Any]:
        entries = [list(e) for e in self.entries]
        if entries and self._current is not None:
            entries[0][2] = self._current.state_dict()
        snapshot = {"entries": entries, "step": self.step, "offset": self.offset, "position": self.position,
                    "kept": self.kept, "done": list(self.done)}
        if self.pad is not None:
            snapshot.update(pad=self.pad, padded=self.padded)
        return snapshot


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
    for rank_state in rank_states:
        if any("pad" in plan for plan in rank_state["plans"].values()):
            raise StreamPositionError(
                f"{where} is inside an epoch that was itself resumed at another world size or number of workers: "
                "its rest was dealt by examples, and what the workers consumed of it interleaves (it is not a "
                f"prefix of the rest), so it moves only to the sizes that epoch ran at ({len(rank_states)} ranks). "
                "Resume at those sizes, or from a checkpoint taken at an epoch's end")
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
