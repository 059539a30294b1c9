"""Exact resume: every rank's random number generators, saved in a checkpoint and restored rank by rank.

``state["resume"] = fabric.resume_state()`` puts a :class:`ResumeState` into the state dict. Saving it is a
collective (one ``all_gather_object`` of a few KiB per rank): rank 0's file then holds, for every rank, the
states of torch's CPU generator, every CUDA device's generator (when CUDA is initialised), numpy's global
generator (when numpy is installed) and Python's ``random``. Loading restores each rank's own states. The
stored values are tensors, ints and tuples only, so the file loads with ``weights_only=True``. Loaded by another
number of ranks (elastic resume), the ranks that existed get their own states back and a new rank seeds its
generators from rank 0's saved state and its rank number (:func:`new_rank_seed`; the loader's side of an elastic
resume is ``fabriclite.data.elastic_dealing``, whose one warning these notes join).

Together with the loader's position (``FabricDataLoader.state_dict``) this makes a resumed run draw the same
random numbers (dropout, augmentations in the main process, shuffles) as one that never stopped.

Under plain DDP it also holds DDP's gradient bucket layout (``ddp_buckets``, from the strategy's
``bucket_layout()``; fabriclite.strategies.ddp_buckets), and loading hands it back (``apply_bucket_layout``), so a
resumed run sums its gradients in the same order as one that never stopped, on any number of ranks. The strategy
is duck-typed here: this floor does not import strategies. Version 1 states (without the layout) still load.
"""
from __future__ import annotations

import hashlib
import random
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from fabriclite.data import elastic_dealing

#: what ``ResumeState.state_dict()`` holds, to recognise it (and its version) on load
FORMAT = "fabriclite.resume"
VERSION = 2


def capture_rng() -> Dict[str, Any]:
    """This process's generator states: ``torch`` (ByteTensor), ``cuda`` (a list, one per device, only when
    CUDA is initialised), ``numpy`` (when numpy is importable) and ``python``."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        name, keys, pos, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set this process's generators to ``state`` (from :func:`capture_rng`); parts absent are left as they
    are (a file written where numpy or CUDA was not in use)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = _numpy()
    if "numpy" in state and numpy is not None:
        name, keys, pos, has_gauss, gauss_np = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss_np))


NOT_EXACT_ON_3_RANKS = (
    "fabric.resume_state(): with strategy='ddp' on 3 or more ranks and static_graph=True or "
    "FABRICLITE_DDP_BUCKET_LAYOUT=0, DDP's gradient bucket layout is not recorded, so a resumed run is not "
    "bit-exact: DDP rebuilds its buckets after its first backward, the resumed run's first step sums the gradients "
    "in another order and the last bits differ. Drop static_graph / unset FABRICLITE_DDP_BUCKET_LAYOUT, or use "
    "strategy='ddp_find_unused_parameters_true' (DDP then keeps its buckets), where bit-exact resume matters.")


def rebuilds_buckets(strategy: Any) -> bool:
    """Whether ``strategy`` is plain DDP, whose first backward rebuilds its gradient buckets (with
    ``find_unused_parameters`` it never does)."""
    return getattr(strategy, "name", None) == "ddp" and not getattr(strategy, "ddp_kwargs", {}).get(
        "find_unused_parameters", False)


def inexact_buckets(strategy: Any) -> bool:
    """Whether ``strategy`` rebuilds DDP's buckets without recording the layout (see NOT_EXACT_ON_3_RANKS)."""
    records = getattr(strategy, "records_bucket_layout", None)
    return rebuilds_buckets(strategy) and not (callable(records) and records())


class ResumeState:
    """The random state of every rank, for a checkpoint (see the module docstring).

    ``state_dict()`` is a collective: every rank must save the same state dict. ``load_state_dict(d)``
    restores this rank's generators; a checkpoint written by a different number of ranks restores the ranks that
    existed then and seeds the new ones from rank 0's state (elastic resume, :func:`new_rank_seed`).
    ``fabric.load(..., strict=...)`` sets ``strict``. Under plain ``ddp`` it saves DDP's gradient bucket layout and
    loading applies it (at any world size: the layout is per parameter). Made under ``ddp`` on 3 or more ranks with
    the layout not recorded (static_graph, or switched off), it warns (on rank 0) that the resume will not be
    bit-exact, naming the fix (:data:`NOT_EXACT_ON_3_RANKS`)."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self.strict = True
        if inexact_buckets(strategy) and strategy.world_size >= 3 and strategy.global_rank == 0:
            warnings.warn(NOT_EXACT_ON_3_RANKS, stacklevel=3)
        #: the states loaded last (every rank's), None before a load
        self.loaded: Optional[List[Dict[str, Any]]] = None

    def state_dict(self) -> Dict[str, Any]:
        """Every rank's generator states, in rank order, and DDP's bucket layout (gathered: call on every rank)."""
        mine = capture_rng()
        strategy = self._strategy
        ranks = [mine] if strategy.world_size == 1 else list(strategy.all_gather_object(mine))
        layout = getattr(strategy, "bucket_layout", None)
        buckets = layout() if callable(layout) else None
        return {"format": FORMAT, "version": VERSION, "world_size": len(ranks), "ranks": ranks,
                "ddp_buckets": buckets}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's generators from ``state`` (see the class docstring for world-size mismatches)."""
        if not isinstance(state, Mapping) or state.get("format") != FORMAT:
            raise ValueError(f"the checkpoint's resume entry is not a fabriclite resume state (expected a dict "
                             f"with format={FORMAT!r}); it was not written by fabric.resume_state().")
        self._apply_buckets(state.get("ddp_buckets"))
        world, rank = self._strategy.world_size, self._strategy.global_rank
        saved = int(state["world_size"])
        if saved != world:
            self._load_elastic(list(state["ranks"]), saved, world, rank)
            return
        self.loaded = list(state["ranks"])
        restore_rng(self.loaded[rank])

    def _apply_buckets(self, buckets: Any) -> None:
        """Hand DDP's recorded bucket layout to the strategy (every rank; any world size: it is per parameter; a layout
        that does not fit the model is a ValueError, or with strict=False a warning)."""
        apply = getattr(self._strategy, "apply_bucket_layout", None)
        if buckets is not None and callable(apply):
            apply(buckets, strict=self.strict)

    def _load_elastic(self, ranks: List[Dict[str, Any]], saved: int, world: int, rank: int) -> None:
        """A checkpoint of ``saved`` ranks loaded by ``world``: a rank that existed gets its own states, a new one
        every generator seeded from rank 0's saved state and its rank (:func:`new_rank_seed`); one note for the
        load's one warning (global rank 0)."""
        self.loaded = ranks
        if rank < saved:
            restore_rng(ranks[rank])
        else:
            seed = new_rank_seed(ranks[0]["torch"], rank)
            torch.manual_seed(seed)
            random.seed(seed)
            numpy = _numpy()
            if numpy is not None:
                numpy.random.seed(seed % 2 ** 32)
        kept = min(saved, world)
        text = (f"the random states were saved by {saved} ranks and this run has {world}: "
                f"{ranks_text(range(kept))} restored {'its' if kept == 1 else 'their'} own")
        if world > saved:
            text += (f"; {ranks_text(range(saved, world))} {'is' if world - saved == 1 else 'are'} new: each "
                     "seeded every generator from rank 0's saved torch state and its rank number "
                     "(fabriclite.checkpoint.elastic.new_rank_seed)")
        else:
            text += f"; the states of {ranks_text(range(world, saved))} were not used"
        elastic_dealing.note(text + ".", self._strategy.global_rank == 0)


def new_rank_seed(rank0_torch_state: torch.Tensor, rank: int) -> int:
    """The seed a rank that did not exist at save time gets for every generator: the first 63 bits of the SHA-256
    of rank 0's saved torch generator state followed by the rank number (8 bytes, little-endian)."""
    data = bytes(rank0_torch_state.to(torch.uint8).flatten().tolist()) + int(rank).to_bytes(8, "little")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & (2 ** 63 - 1)


def ranks_text(ranks: Sequence[int]) -> str:
    """``[2]`` as ``"rank 2"``, ``[0, 1, 2, 5]`` as ``"ranks 0-2, 5"``."""
    parts: List[str] = []
    for rank in sorted(ranks):
        if parts and parts[-1].split("-")[-1] == str(rank - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{rank}"
        else:
            parts.append(str(rank))
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def set_strict(state: Optional[Mapping[str, Any]], strict: bool) -> None:
    """Give every ResumeState in ``state`` (the dict passed to load) the load's ``strict``."""
    for value in (state or {}).values():
        if isinstance(value, ResumeState):
            value.strict = strict


def _python_state() -> tuple:
    version, internal, gauss = random.getstate()
    return version, tuple(internal), gauss


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


__all__ = ["ResumeState", "capture_rng", "inexact_buckets", "new_rank_seed", "ranks_text", "restore_rng", "set_strict"]
