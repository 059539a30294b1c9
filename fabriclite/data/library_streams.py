"""Streaming libraries that keep their own position: litdata (``litdata.StreamingDataLoader`` over a
``litdata.StreamingDataset``) and MosaicML Streaming (``streaming.StreamingDataset`` in a ``DataLoader`` or
``streaming.StreamingDataLoader``).

Both shard by rank and worker themselves, from what they read when the dataset is built, and both keep a sample order
that does not depend on the world size, so that a position saved by W ranks resumes at W' ranks with every sample of
the epoch's rest once (litdata's elastic resume; Streaming's ``num_canonical_nodes``). Their ``state_dict`` methods
take arguments (litdata's dataset: the samples yielded, the workers, the batch size; Streaming's: the samples seen
and ``from_beginning``), so they are not the no-argument state ``worker_snapshots`` takes inside each worker: the
loader is iterated as it is (no wrapper), and the position is the library's own state, taken in the main process
from the batches the loop consumed (:meth:`LibraryStream.state`) and handed back to the library before the resumed
epoch's first batch (:meth:`LibraryStream.start`). At another world size or number of workers, Streaming resumes
from any position (every sample once, at most W' - 1 repeats, counted by :meth:`LibraryStream.padding`); litdata
from whole rounds of the new sizes' batches, else ``StreamPositionError`` (:meth:`LibraryStream.refusal`). The state is plain (dicts, lists, str, int, float, bool, None:
loadable with ``weights_only=True``).

Neither library is imported here: a loader is recognised by the modules its classes come from (:func:`library_of`).
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

#: kind -> (the library's package, as pip names it, and the version fabriclite's tests pin)
LIBRARIES = {"litdata": ("litdata", "0.2.76"), "streaming": ("mosaicml-streaming", "0.13.0")}


def _from(obj: Any, package: str, name: str) -> bool:
    """Whether ``obj``'s class (or a base) is ``name`` from ``package`` (nothing is imported)."""
    return any(cls.__name__ == name and cls.__module__.split(".")[0] == package for cls in type(obj).__mro__)


def library_of(loader: Any) -> Optional[str]:
    """``"litdata"`` or ``"streaming"`` for a loader over one of these libraries' datasets, else None."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return None
    if _from(dataset, "litdata", "StreamingDataset"):
        return "litdata"
    if _from(dataset, "streaming", "StreamingDataset"):
        return "streaming"
    return None


def plain(value: Any, where: str = "state") -> Any:
    """``value`` with numpy scalars and tuples made plain Python (what ``torch.load(weights_only=True)`` reads);
    anything else that is not plain is a TypeError naming where it sits."""
    if isinstance(value, dict):
        return {plain(k, where): plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)  # a numpy scalar
    if callable(item) and getattr(value, "shape", None) == ():
        return plain(item(), where)
    raise TypeError(f"{where} is a {type(value).__name__}, which a checkpoint loaded with weights_only=True cannot "
                    "hold")


class LibraryStream:
    """The position of one loader over a litdata or MosaicML Streaming dataset, for ``rank`` of ``world_size``."""

    def __init__(self, kind: str, loader: Any, rank: int, world_size: int) -> None:
        self.kind, self.loader, self.rank, self.world_size = kind, loader, int(rank), int(world_size)
        self.dataset = loader.dataset
        if kind == "litdata" and not _from(loader, "litdata", "StreamingDataLoader"):
            raise TypeError(
                f"A litdata StreamingDataset in a {type(loader).__name__} cannot be resumed: litdata keeps its position "
                "in litdata.StreamingDataLoader (the samples each worker yielded). Fix: "
                "litdata.StreamingDataLoader(dataset, batch_size=..., num_workers=...) instead of a DataLoader.")
        self.check_ranks()
        self._base = (0, 0)  # (samples, batches) of the running epoch when it started: a resumed epoch's position

    # ------------------------------------------------------------------ the ranks the library sees
    def seen(self) -> Dict[str, int]:
        """The rank and world size the library read when its dataset was built."""
        if self.kind == "litdata":
            env = self.dataset.distributed_env
            return {"rank": int(env.global_rank), "world_size": int(env.world_size)}
        world = self.dataset._unique_rank_world
        return {"rank": int(world.rank), "world_size": int(world.num_ranks)}

    def check_ranks(self) -> None:
        """ValueError when the library's dataset shards for another rank or world size than this job's (each rank
        would train the same samples, or some never)."""
        seen = self.seen()
        if seen == {"rank": self.rank, "world_size": self.world_size}:
            return
        package = LIBRARIES[self.kind][0]
        reads = {"litdata": "WORLD_SIZE, GLOBAL_RANK and NNODES, or torch.distributed when it is initialised",
                 "streaming": "RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE"}[self.kind]
        raise ValueError(
            f"This {package} StreamingDataset shards its samples for rank {seen['rank']} of {seen['world_size']}, but "
            f"it is loaded on rank {self.rank} of {self.world_size}: every rank would train another rank's share (or "
            f"the same samples). {package} reads {reads} when the dataset is built. Fix: build the dataset after "
            "fabric.launch() (fabriclite's launchers, `fabriclite run` and script mode, set RANK, WORLD_SIZE, "
            "LOCAL_RANK and LOCAL_WORLD_SIZE for each rank, and torch.distributed is initialised then), or set those "
            "variables before building it.")

    # ------------------------------------------------------------------ saving
    def state(self, batches: int) -> Dict[str, Any]:
        """The library's own state after the loop consumed ``batches`` batches of the running epoch (the same on
        every rank: the libraries count the job's samples as batches x batch size x world size), and ``samples``: the
        samples of the epoch the job consumed (a resumed epoch counts those before its resume at the saved size)."""
        samples = self._base[0] + (int(batches) - self._base[1]) * int(self.loader.batch_size or 1) * self.world_size
        if self.kind == "litdata":
            own = self.loader.state_dict()
            samples = int(own["dataset"].get("sample_in_epoch", samples))
        else:
            own = self.dataset.state_dict(samples, True)
        return {"kind": self.kind, "state": plain(own, f"the {self.kind} loader's state"), "samples": samples,
                "world_size": self.world_size, "num_workers": int(self.loader.num_workers)}

    def refusal(self, saved: Dict[str, Any], num_workers: int) -> Optional[str]:
        """Why the position ``saved`` (:meth:`state`, from another world size or number of workers) cannot be
        resumed here, or None.

        MosaicML Streaming: never. Its epoch is one order of samples that does not depend on the world size (with
        ``num_canonical_nodes`` fixed), a rank's batches are its consecutive samples of that order, so the samples
        consumed are the first ``samples`` of it, whatever the sizes; it drops exactly those and deals the rest
        sample by sample over this run's ranks, padded with at most W' - 1 repeats (:meth:`padding`).

        litdata deals an epoch's rest in whole global batches of this run's size: it rounds the samples consumed
        down to such a batch (repeating the samples past it), and from such a position it also loses some of the
        rest: litdata 0.2.76 alone (no fabriclite), 96 samples, batch 4, 2 workers, saved by 3 ranks after 60 samples
        and resumed at 2, repeats 4 samples and never yields 8 (60-63, 92-95); after 24 samples (a whole global
        batch of 2 ranks, not of 2 ranks x 2 workers) it loses the same 8. Every sample once (at most W' - 1
        repeats) holds only from a position that is a whole number of rounds of batch size x world size x workers
        (the lane's tests), so other positions are refused."""
        if self.kind == "streaming":
            return None
        batch, workers = int(self.loader.batch_size or 1), max(1, int(num_workers))
        step = batch * self.world_size * workers
        samples = int(saved["samples"])
        if samples % step == 0:
            return None
        old = int(saved["world_size"]) * batch
        fit = next(b for b in range(1, step + 1) if (b * old) % step == 0)
        return (f"litdata resumes at another size from whole rounds of this run's batches only "
                f"(batch size x world size x workers = {batch} x {self.world_size} x {workers} = {step} samples "
                f"here), and the position is {samples} samples into the epoch, not a multiple of {step}: litdata "
                f"rounds the position down, and would repeat up to {step - 1} samples. Save at a batch that is a "
                f"multiple of {fit} (at {saved['world_size']} ranks) to move to {self.world_size} ranks")

    def padding(self, saved: Dict[str, Any], num_workers: int) -> int:
        """The samples the library repeats in the epoch's rest resumed from ``saved`` at this run's sizes, so that
        every rank yields as many (Streaming pads the rest to whole rounds of its ranks; at most W' - 1). Computed by
        the library's own partition of the rest (0 for litdata: it resumes only from whole rounds)."""
        if self.kind != "streaming":
            return 0
        from streaming.base.partition import get_partitions  # the user's loader is a Streaming one: imported

        world = self.dataset._parallel_rank_world
        state = saved["state"]
        drop = int(state.get("sample_in_epoch", saved["samples"]))
        ids = get_partitions(self.dataset.partition_algo, int(self.dataset.epoch_size),
                             int(state.get("num_canonical_nodes") or self.dataset.num_canonical_nodes or 1),
                             int(world.num_nodes), int(world.ranks_per_node), max(1, int(num_workers)),
                             int(self.loader.batch_size or 1), drop, state.get("initial_physical_nodes"))
        return int((ids >= 0).sum()) - (int(self.dataset.epoch_size) - drop)

    # ------------------------------------------------------------------ iterating
    def start(self, epoch: int, resume: Optional[Dict[str, Any]], resume_batches: int = 0) -> None:
        """Before the first batch of ``epoch``: the library starts that epoch (its own epoch counter set to
        fabriclite's, so its shuffle matches an uninterrupted run), at the position ``resume`` (:meth:`state`) if
        given (saved after ``resume_batches`` batches of the epoch)."""
        self._base = (int(resume["samples"]), int(resume_batches)) if resume is not None else (0, 0)
        if self.kind == "litdata":
            if resume is not None:
                self.loader.load_state_dict(json.loads(json.dumps(resume["state"])))
            else:
                self.loader.restore = False
                self.loader.current_epoch = int(epoch)  # litdata counts epochs from 1: its __iter__ adds one
            return
        if resume is not None:
            self.dataset.load_state_dict(dict(resume["state"]))
        elif int(self.dataset.next_epoch) != int(epoch):
            self.dataset.load_state_dict(self._epoch_start(int(epoch)))

    def _epoch_start(self, epoch: int) -> Dict[str, Any]:
        """A Streaming state at the start of ``epoch``, made from the dataset's settings. Not from its
        ``state_dict()``: that reads the node's shared resume block, which another rank may have created and not yet
        written (its ``load_state_dict`` of this same state): the read fails on this rank, and the other ranks'
        workers wait for this rank's in Streaming's node barrier for ever."""
        nodes = int(self.dataset._parallel_rank_world.num_nodes)
        canonical = self.dataset.num_canonical_nodes
        if not canonical:  # what Streaming's own _resume picks when none was given
            canonical = 64 * nodes if self.dataset.shuffle_algo in ("py1s", "py2s") else nodes
        initial = self.dataset.initial_physical_nodes
        return {"epoch": epoch, "sample_in_epoch": 0, "num_canonical_nodes": int(canonical),
                "shuffle_seed": int(self.dataset.shuffle_seed),
                "initial_physical_nodes": nodes if initial is None else int(initial)}


def describe(kind: str) -> str:
    """The loader kind in words, for messages."""
    return {"litdata": "litdata StreamingDataLoader (litdata keeps the position)",
            "streaming": "MosaicML Streaming StreamingDataset (Streaming keeps the position)"}[kind]


__all__ = ["LIBRARIES", "LibraryStream", "describe", "library_of", "plain"]
