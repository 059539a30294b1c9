"""A streaming loader's position across a checkpoint: what ``FabricDataLoader`` adds to its state for a loader over
an ``IterableDataset`` (or a torchdata ``StatefulDataLoader``), and how an epoch resumes from it.

- Saving inside an epoch (``Streams.record``): the sizes the position holds for (world size, ``num_workers``, the
  kind: ``stream_kinds``) and, for a stateful stream, every rank's per-worker states of the batches the
  loop consumed (``worker_snapshots``), gathered to every rank so that rank 0's file holds them all; for a
  Hugging Face stream dealt by shards also each worker's stream of shards (``hf_shards``); for a
  ``StatefulDataLoader`` its own ``state_dict()``, per rank. ``record`` is a collective then: ``fabric.save`` calls
  it on every rank.
- Loading (``Streams.load``): ``stream_kinds.plan`` decides; the position that cannot be carried over raises
  ``StreamPositionError`` before the first batch.
- The next epoch (``Streams.batches``): resumed from each worker's own state (same sizes), replayed (a stateless
  stream at the same sizes), or the shards' rest dealt again over this run's ranks and workers, padded so that every
  rank yields the same number of batches (named and counted in one warning), or cut with ``drop_last``.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader

from fabriclite.data import elastic_dealing, epoch_position, hf_shards, library_streams, stream_kinds, worker_snapshots

_END = object()


class Streams:
    """The stream side of one ``FabricDataLoader`` (over ``loader``, for ``strategy``'s rank)."""

    def __init__(self, loader: DataLoader, strategy: Any) -> None:
        self.loader, self.strategy = loader, strategy
        self.world_size, self.rank = int(strategy.world_size), int(strategy.global_rank)
        # a loader that is not a DataLoader (torch_xla's MpDeviceLoader, which the xla strategy's loaders are) has no
        # dataset or workers of its own here: its stream, if any, is not tracked, as before streams were
        plain = hasattr(loader, "dataset") and hasattr(loader, "num_workers")
        self.num_workers = int(loader.num_workers) if plain else 0
        self.torchdata = stream_kinds.is_torchdata_loader(loader)
        self.kind = stream_kinds.stream_kind(loader, self.world_size) if plain else None
        if self.torchdata and self.kind == "shards":
            self.kind = "stateful"  # torchdata runs the stream with its own states: fabriclite deals no shards
        # litdata / Streaming: the library keeps its own position (library_streams); the loader runs unwrapped
        self.library = library_streams.LibraryStream(self.kind, loader, self.rank, self.world_size) \
            if self.kind in library_streams.LIBRARIES else None
        self.ignore = False
        self._tagged: Optional[DataLoader] = None  # the plain epochs' tagged loader (its persistent workers)
        self._pending: Optional[Dict[str, Any]] = None  # how the next epoch resumes
        self._consumed: Optional[worker_snapshots.Consumed] = None  # the running epoch's consumed tags
        self._plans: Optional[Dict[int, Dict[str, Any]]] = None  # the running epoch's shard streams per worker
        self._dealt = False  # the running epoch is a dealt rest (its ranks run in lockstep to its end)

    @property
    def tagged(self) -> bool:
        """Whether batches carry per-worker states (a stateful stream not run by torchdata)."""
        return self.kind in ("stateful", "shards") and not self.torchdata

    # ------------------------------------------------------------------ saving
    def record(self, state: Dict[str, Any], running: bool) -> Dict[str, Any]:
        """``state`` (the loader's position) with the stream's part (see the module docstring)."""
        if self.kind is None and not self.torchdata:
            return state
        if self.kind is not None:
            state.update(world_size=self.world_size, num_workers=self.num_workers, stream=self.kind)
            if self.kind != "shards" and stream_kinds.is_hf_iterable(self.loader.dataset):
                state["hf_refusal"] = stream_kinds.shards_refusal(self.loader.dataset, self.world_size,
                                                                  self.num_workers)
        if not running or int(state.get("batch", 0)) == 0:
            return state
        if self.library is not None:
            state["library"] = self.library.state(int(state["batch"]))  # the same on every rank: no gather
            return state
        if self.torchdata:
            state["torchdata"] = self._gather(self.loader.state_dict())  # type: ignore[attr-defined]
        elif self.tagged:
            assert self._consumed is not None
            mine = self._consumed.state()
            if self.kind == "shards":
                mine.update(plans=self._plans, dealt=self._dealt)
            ranks = self._gather(mine)
            if self.kind == "stateful" and worker_snapshots.all_ended(ranks, self.num_workers):
                return {**state, "epoch": int(state["epoch"]) + 1, "batch": 0}  # an epoch's end is the next's start
            state["ranks"] = ranks
        return state

    def _gather(self, obj: Any) -> List[Any]:
        return self.strategy.all_gather_object(obj) if self.world_size > 1 else [obj]

    # ------------------------------------------------------------------ loading
    def load(self, state: Dict[str, Any]) -> Optional[int]:
        """Prepare the next epoch to resume from ``state`` (a position inside an epoch written by this fabriclite,
        with ``"stream"`` or ``"torchdata"``): the batches to replay (None: none, the position is taken over here)."""
        self._pending = None
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if "torchdata" in state and "stream" not in state:
            return None  # a map-style StatefulDataLoader: epoch_position decides, torchdata's state follows
        refusal = stream_kinds.shards_refusal(self.loader.dataset, self.world_size, self.num_workers) \
            if stream_kinds.is_hf_iterable(self.loader.dataset) else None
        how = stream_kinds.plan(state, self.kind, self.world_size, self.num_workers, self.ignore, refusal)
        if how == "restart":
            return 0
        if how == "replay":
            return batch
        if how == "library":
            self._pending = {"how": "library", "state": state["library"], "batch": batch}
            saved = (int(state["world_size"]), int(state.get("num_workers", 0)))
            if saved != (self.world_size, self.num_workers):
                assert self.library is not None
                why = self.library.refusal(state["library"], self.num_workers)
                if why is not None:
                    self._pending = None
                    raise stream_kinds.refuse(state, self.world_size, self.num_workers, why)
                padded = self.library.padding(state["library"], self.num_workers)
                elastic_dealing.note(
                    f"the stream's position was saved by {stream_kinds.sizes(*saved)} and this run has "
                    f"{stream_kinds.sizes(self.world_size, self.num_workers)}: epoch {epoch} continues from "
                    f"{library_streams.LIBRARIES[self.kind][0]}'s own state (its elastic resume), which deals the "
                    f"epoch's rest over this run's ranks and workers: {padded} sample{'' if padded == 1 else 's'} "
                    f"repeated as padding (at most {self.world_size - 1}, as DistributedSampler pads).",
                    self.rank == 0)
            return 0
        if "torchdata" in state:
            self._pending = {"how": "torchdata", "state": state["torchdata"][self.rank], "batch": batch}
            return 0
        ranks = state["ranks"]
        if how == "states":
            mine = ranks[self.rank]
            self._pending = {"how": "states", "tags": mine.get("workers", {}), "plans": mine.get("plans"),
                             "batch": batch, "dealt": bool(mine.get("dealt")),
                             "first_worker": worker_snapshots.next_worker(mine, self.num_workers),
                             "last_worker": mine.get("last_worker")}
            return 0
        where = f"The loader's position, batch {batch} of epoch {epoch}"
        rest = hf_shards.rest(ranks, where)
        plans = hf_shards.deal(rest, self.world_size, self.num_workers)
        self._pending = {"how": "deal", "plans": plans[self.rank], "batch": 0, "dealt": True, "rest": rest}
        started = sum(1 for entry in rest if entry[1])
        saved = stream_kinds.sizes(int(state["world_size"]), int(state.get("num_workers", 0)))
        now = stream_kinds.sizes(self.world_size, self.num_workers)
        elastic_dealing.note(f"the stream's position was saved by {saved} and this run has {now}: epoch {epoch} "
                             f"continues with the {len(rest)} shards left ({started} of them part-read, each resumed "
                             "at its offset), dealt by examples over this run's ranks and workers; a rank one example "
                             "short repeats its first as padding (at most W' - 1 over the job, counted in a warning at "
                             "the epoch's end).", self.rank == 0)
        return 0

    def resume_torchdata(self, states: List[Any], batch: int) -> None:
        """Start the next epoch from this rank's StatefulDataLoader state in ``states`` (a map-style loader at the
        same world size: torchdata skips the consumed indices in the sampler)."""
        self._pending = {"how": "torchdata", "state": states[min(self.rank, len(states) - 1)], "batch": batch}

    def pending_torchdata(self) -> Optional[Any]:
        """The StatefulDataLoader state the next epoch starts from (taken off), or None."""
        if self._pending is not None and self._pending["how"] == "torchdata":
            pending, self._pending = self._pending, None
            return pending["state"]
        return None

    def start_library(self, epoch: int) -> None:
        """Before ``epoch``'s first batch, for a litdata / Streaming loader: the library starts that epoch, from the
        pending position if one was loaded."""
        if self.library is None:
            return
        pending, batches = None, 0
        if self._pending is not None and self._pending["how"] == "library":
            pending, batches, self._pending = self._pending["state"], int(self._pending["batch"]), None
        self.library.start(epoch, pending, batches)

    def resumed_batches(self) -> int:
        """The batches already consumed in the epoch the next ``iter()`` resumes (0 for a plain epoch)."""
        return int(self._pending["batch"]) if self._pending is not None else 0

    def forget(self) -> None:
        """Drop a pending resume (``set_epoch``)."""
        self._pending = None

    # ------------------------------------------------------------------ iterating
    def _plain_plans(self) -> Optional[Dict[int, Dict[str, Any]]]:
        if self.kind != "shards":
            return None
        shards = int(self.loader.dataset._ex_iterable.num_shards)  # type: ignore[attr-defined]
        workers = max(1, self.num_workers)
        return {w: hf_shards.plain_plan(shards, self.rank, self.world_size, w, workers) for w in range(workers)}

    def _source(self, plans: Optional[Dict[int, Dict[str, Any]]]) -> Any:
        if self.kind == "shards":
            return hf_shards.ShardDealer(self.loader.dataset, self.rank, self.world_size, plans)
        return worker_snapshots.DatasetSource(self.loader.dataset)

    def batches(self) -> Iterator[Any]:
        """The running epoch's batches (a tagged stream: see the module docstring), untagged."""
        pending, self._pending = self._pending, None
        if pending is None:
            if self._tagged is None:
                self._tagged = worker_snapshots.snapshot_loader(self.loader, self._source(None))
            loader, self._plans, start = self._tagged, self._plain_plans(), None
        elif pending["how"] == "states":
            plans = {int(w): p for w, p in pending["plans"].items()} if pending["plans"] is not None else None
            tagged = worker_snapshots.snapshot_loader(self.loader, self._source(plans))
            start = pending["tags"]
            loader = worker_snapshots.resumed_copy(tagged, worker_snapshots.worker_states({"workers": start}),
                                                   pending["first_worker"])
            self._plans = plans if plans is not None else self._plain_plans()
        else:  # deal
            self._plans = {int(w): p for w, p in pending["plans"].items()}
            loader, start = worker_snapshots.snapshot_loader(self.loader, self._source(self._plans)), None
        self._consumed = worker_snapshots.Consumed(start)
        if pending is not None and pending.get("last_worker") is not None:
            self._consumed.last_worker = int(pending["last_worker"])
        self._dealt = pending is not None and bool(pending.get("dealt"))
        # a resumed epoch's iterator does not draw from torch's generator: an uninterrupted run drew before the save
        iterator = iter(loader) if pending is None else epoch_position.quiet_iter(loader)
        if self._dealt:
            whole = {0: {"entries": pending.get("rest") or [], "step": 1, "offset": 0}}  # type: ignore[union-attr]
            fallback = worker_snapshots.snapshot_loader(self.loader, self._source(whole))
            yield from self._lockstep(loader, iterator, fallback)
            return
        for data, tag in iterator:
            self._consumed.hand_out(tag)
            yield data

    def _lockstep(self, loader: DataLoader, iterator: Iterator[Any], fallback: DataLoader) -> Iterator[Any]:
        """A dealt epoch's rest: every rank yields the same number of batches (padding, or drop_last). Padding
        repeats the start of this rank's share, or of the whole rest (``fallback``) for a rank whose share is
        empty."""
        assert self._consumed is not None
        padding, pads, left_out, ended = None, 0, 0, False
        drop_last = bool(self.loader.drop_last)
        while True:
            item = _END if ended else next(iterator, _END)
            ended = item is _END  # (persistent workers: the padding's iter() resets this very iterator)
            have = self.strategy.flat_all_reduce(torch.tensor([0 if item is _END else 1]), "sum")
            ranks_with = int(have.item())
            if ranks_with == 0:
                break
            if ranks_with < self.world_size and drop_last:
                left_out += 0 if item is _END else 1
                break
            if item is _END:
                if padding is None or (item := next(padding, _END)) is _END:
                    padding = epoch_position.quiet_iter(loader)  # the start of this rank's share again
                    item = next(padding, _END)
                    if item is _END:  # this rank's share is empty: the start of the whole rest
                        loader = fallback
                        padding = epoch_position.quiet_iter(loader)
                        item = next(padding)  # another rank has a batch, so the rest has one
                pads += 1
                yield item[0]
                continue
            self._consumed.hand_out(item[1])
            yield item[0]
        padded = sum(int((tag.get("state") or {}).get("padded", 0)) for tag in self._consumed.tags.values()
                     if isinstance(tag.get("state"), dict))
        repeats = self._gather(padded)
        if self.rank == 0 and sum(repeats):
            named = ", ".join(f"rank {r}: {n}" for r, n in enumerate(repeats) if n)
            warnings.warn(f"Elastic resume: the resumed epoch's rest was dealt by examples over {self.world_size} "
                          f"ranks; so that every rank yields the same number of batches, {sum(repeats)} repeated as "
                          f"padding ({named}: a rank one example short repeats its first; at most "
                          f"{self.world_size - 1}, as DistributedSampler pads).", stacklevel=2)
        counts = self._gather((pads, left_out))
        if self.rank == 0 and any(p or c for p, c in counts):
            text = ", ".join(f"rank {r}: {p} padding batch{'' if p == 1 else 'es'}" + (f", {c} left out" if c else "")
                             for r, (p, c) in enumerate(counts) if p or c)
            warnings.warn(f"Elastic resume: the resumed epoch's rest ended unevenly over the ranks; so that every "
                          f"rank yields the same number of batches, {text} (padding repeats the start of that "
                          "rank's share of the rest; drop_last leaves batches out instead).", stacklevel=2)


__all__ = ["Streams"]
