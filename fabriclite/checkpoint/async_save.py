"""Saves that do not stall training: the state is snapshotted, then written in the background.

- One-file strategies: ``AsyncCheckpointIO(checkpoint_io=None)`` (``fabriclite.plugins.io``; the name and shape of
  Lightning Trainer's plugin) wraps another CheckpointIO (default ``TorchCheckpointIO``): ``save_checkpoint`` copies
  every tensor of the checkpoint (on the caller's thread, so later optimizer steps cannot leak into it; with the
  default TorchCheckpointIO into the previous snapshot's tensors when they match, which stay allocated between
  saves) and returns; a background thread runs the wrapped plugin's ``save_checkpoint``.
- Sharded strategies (``FSDPStrategy(async_save=True)``, ``ModelParallelStrategy(async_save=True)``): every rank
  stages its shard with torch.distributed.checkpoint's ``async_save`` (a CPU copy, made before it returns), which
  writes it from a background thread over a gloo process group of its own (created at the first save; training's
  collectives keep the main group). Then, still in the background, rank 0 writes ``meta.pt``, the ranks agree
  that every shard is written, and rank 0 swaps the directory in.

Either way: at most one save is in flight per rank (a second one waits for the first: one snapshot of memory);
``save(..., keep=K)`` records the checkpoint in the manifest only once every rank's part is durable, so
``load_latest`` never sees a half-written one; an error in the background is raised, naming the path, by the next
save, by the next load, or when the strategy is torn down (the end of the job, which waits for the save: so does
the exit after a preemption). The background thread is not a daemon: the interpreter waits for it at exit.
"""
from __future__ import annotations

import copy
import os
import secrets
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fabriclite.checkpoint import integrity
from fabriclite.checkpoint.atomic import outcome, raise_failure, remove_path, swap_in, tmp_name
from fabriclite.checkpoint.checkpoint_io import CheckpointIO, PathLike, TorchCheckpointIO
from fabriclite.collectives import object_wire

#: what runs once a checkpoint is complete on every rank (global rank 0): its files' digests -> None
OnComplete = Callable[[Dict[str, Dict[str, Any]]], None]


class AsyncSaveError(RuntimeError):
    """A background save failed; ``path`` is the checkpoint. Raised by the next save or load, or at teardown."""

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = path
        super().__init__(f"The asynchronous save of {path} failed: {type(cause).__name__}: {cause}. That checkpoint "
                         "was not recorded; the previous one is intact.")


class InFlight:
    """At most one background job: ``start`` waits for the one before; ``wait`` joins it and raises its error
    (once)."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[AsyncSaveError] = None

    def start(self, job: Callable[[], None], path: str) -> None:
        self.wait()
        thread = threading.Thread(target=self._run, args=(job, path), name="fabriclite-checkpoint", daemon=False)
        self._thread = thread
        thread.start()

    def _run(self, job: Callable[[], None], path: str) -> None:
        try:
            job()
        except BaseException as err:  # noqa: BLE001 - kept for the caller's thread, never lost
            self._error = AsyncSaveError(path, err)
            self._error.__cause__ = err

    def wait(self) -> None:
        """Block until the job in flight (if any) is done; raise its AsyncSaveError."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def snapshot(obj: Any, reuse: Sequence[torch.Tensor] = ()) -> Tuple[Any, List[torch.Tensor]]:
    """A copy of ``obj`` whose tensors are detached copies (containers rebuilt, other leaves deep-copied), made on
    this thread: nothing done to the live state later reaches it. ``reuse``: the tensors of an earlier snapshot
    that is no longer needed; when they match (count, shapes, dtypes, devices) they are copied into, which costs
    no new memory and no page faults. Returns the copy and its tensors (to reuse next time)."""
    unique = list({id(t): t for t in _tensors(obj)}.values())
    if len(reuse) == len(unique) and all(b.shape == t.shape and b.dtype == t.dtype and b.device == t.device
                                         and type(b) is type(t) for b, t in zip(reuse, unique)):
        copies = [b.copy_(t.detach()) for b, t in zip(reuse, unique)]
    else:
        copies = [t.detach().clone() for t in unique]
    memo: Dict[int, Any] = {id(t): c for t, c in zip(unique, copies)}
    return copy.deepcopy(obj, memo), copies


def _tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


class AsyncCheckpointIO(CheckpointIO):
    """Writes checkpoints in a background thread through ``checkpoint_io`` (default: ``TorchCheckpointIO``); see
    the module docstring. ``load_checkpoint`` waits for the save in flight first; ``teardown`` waits for it and
    raises its error."""

    def __init__(self, checkpoint_io: Optional[CheckpointIO] = None) -> None:
        if checkpoint_io is not None and not isinstance(checkpoint_io, CheckpointIO):
            raise TypeError(f"AsyncCheckpointIO(checkpoint_io={checkpoint_io!r}): expected a CheckpointIO to wrap.")
        if isinstance(checkpoint_io, AsyncCheckpointIO):
            raise TypeError("AsyncCheckpointIO(checkpoint_io=AsyncCheckpointIO(...)): wrap the plugin that writes "
                            "(one background thread is enough).")
        #: the wrapped plugin that does the writing
        self.checkpoint_io: CheckpointIO = checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()
        self._inflight = InFlight()
        self._buffers: List[torch.Tensor] = []  # the last snapshot's tensors, copied into by the next one

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: PathLike, storage_options: Optional[Any] = None) -> None:
        """Wait for the save in flight (raising its error), snapshot ``checkpoint``, write it in the background."""
        self.save_in_background(checkpoint, path, storage_options)

    def save_in_background(self, checkpoint: Dict[str, Any], path: PathLike, storage_options: Optional[Any] = None,
                           then: Optional[Callable[[], None]] = None,
                           end: Optional[Callable[[], None]] = None) -> None:
        """``save_checkpoint``, and ``then()`` in the background once the wrapped plugin has returned; ``end()``
        after it, whether the write worked or not."""
        self._inflight.wait()
        inner = self.checkpoint_io
        if isinstance(inner, TorchCheckpointIO):
            inner.check_storage_options(storage_options)  # its TypeError now, not in the background
        # fabriclite's own writer keeps no reference to what it wrote: its buffers can be copied into next time
        reusable = type(inner) is TorchCheckpointIO
        copied, buffers = snapshot(checkpoint, self._buffers if reusable else ())
        self._buffers = buffers if reusable else []

        def job() -> None:
            try:
                inner.save_checkpoint(copied, path, storage_options=storage_options)
                if then is not None:
                    then()
            finally:
                if end is not None:
                    end()

        self._inflight.start(job, os.fspath(path))

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        self._inflight.wait()
        if map_location is None:
            return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        return self.checkpoint_io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: PathLike) -> None:
        self.checkpoint_io.remove_checkpoint(path)

    def wait(self) -> None:
        """Block until the save in flight is written (and recorded); raise its AsyncSaveError."""
        self._inflight.wait()

    def teardown(self) -> None:
        try:
            self._inflight.wait()
        finally:
            self.checkpoint_io.teardown()


class AsyncShardedSaves:
    """A sharded strategy's asynchronous saves (see the module docstring). One per strategy instance."""

    def __init__(self) -> None:
        self._inflight = InFlight()
        self._group: Any = None

    def _background_group(self, strategy: Any) -> Any:
        """The gloo group the background work runs its collectives on (created on every rank at the first save)."""
        if self._group is None and strategy.world_size > 1:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=getattr(strategy, "timeout", None))
        return self._group

    def save(self, strategy: Any, path: str, writer: Any, tmp_tag: str, on_complete: Optional[OnComplete],
             on_end: Optional[Callable[[], None]] = None) -> None:
        """Stage ``writer``'s shards and start writing them to ``path`` (a ``dcp.ShardedWriter``); call on every
        rank. Returns once this rank's shard is copied; the checkpoint appears at ``path`` (and ``on_complete`` runs
        on rank 0) once every rank's part is written; ``on_end`` runs on rank 0 after that, or after the failure."""
        from torch.distributed import checkpoint as dcp

        from fabriclite.checkpoint.dcp import storage_writer

        self._inflight.wait()
        group = self._background_group(strategy)
        parent, name = os.path.split(path)
        token = strategy.broadcast_object(secrets.token_hex(4) if strategy.is_global_zero else None, 0)
        tmp = tmp_name(parent, name, tmp_tag, token)
        os.makedirs(tmp, exist_ok=True)
        dcp_writer, write_errors = storage_writer(tmp)
        future = dcp.async_save(writer.tensors, checkpoint_id=tmp, storage_writer=dcp_writer, process_group=group,
                                no_dist=strategy.world_size == 1)  # the shard is copied (staged) before it returns
        metadata = snapshot(writer.metadata)[0] if strategy.is_global_zero else {}
        rank, world = strategy.global_rank, strategy.world_size

        def job() -> None:
            error: Optional[BaseException] = None
            mine: Dict[str, Dict[str, Any]] = {}
            try:
                try:
                    future.result()
                except BaseException as err:  # noqa: BLE001 - DCP's errors are BaseExceptions
                    write_errors.raise_recorded(path, err)
                    raise
                writer.write_metadata(metadata, tmp, path)
                if on_complete is not None:
                    names = integrity.files_of(parent, os.path.basename(tmp))
                    mine = {_renamed(rel, name): d for rel, d in integrity.digests(parent, names, rank, world).items()}
            except BaseException as err:  # noqa: BLE001 - every rank must hear of it
                error = err
            gathered = _all_gather(group, world, (mine, outcome(error, rank)))
            outcomes = [told for _, told in gathered]
            final: Optional[str] = None
            if rank == 0:
                if any(outcomes):
                    remove_path(tmp)
                else:
                    try:
                        swap_in(tmp, path)
                        if on_complete is not None:
                            on_complete({k: v for files, _ in gathered for k, v in files.items()})
                    except BaseException as err:  # noqa: BLE001 - every rank must hear of it
                        final = f"{type(err).__name__}: {err}"
            final = _broadcast(group, world, final)
            if rank == 0 and on_end is not None:
                on_end()
            if any(outcomes):
                raise_failure(path, outcomes, error)
            if final is not None:
                raise RuntimeError(f"every rank wrote its part of {path}, then rank 0 failed: {final}")

        self._inflight.start(job, path)

    def wait(self) -> None:
        """Block until this rank's part of the save in flight is done; raise its AsyncSaveError."""
        self._inflight.wait()


def _renamed(relative: str, name: str) -> str:
    """``relative`` (under the temporary directory) as it reads once swapped in under ``name``."""
    return name + "/" + relative.split("/", 1)[1]


def _all_gather(group: Any, world: int, value: Any) -> List[Any]:
    """Every rank's ``value`` over the background ``group`` (gloo), loaded with fabriclite's restricted unpickler."""
    if world == 1:
        return [value]
    import torch.distributed as dist

    def gather(t: torch.Tensor) -> torch.Tensor:
        rows = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(rows, t, group=group)
        return torch.stack(rows)
    return object_wire.all_gather_objects(value, gather, torch.device("cpu"))


def _broadcast(group: Any, world: int, value: Optional[str]) -> Optional[str]:
    """Global rank 0's ``value`` over the background ``group``, loaded with fabriclite's restricted unpickler."""
    if world == 1:
        return value
    import torch.distributed as dist

    def broadcast(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0, group=group)
        return t
    return object_wire.broadcast_object(value, dist.get_rank() == 0, broadcast, torch.device("cpu"))


__all__ = ["AsyncCheckpointIO", "AsyncSaveError", "AsyncShardedSaves", "InFlight", "snapshot"]
