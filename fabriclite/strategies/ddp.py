"""DDP: one process per device, a torch.distributed process group (gloo on CPU, nccl on CUDA)."""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable, ContextManager, Dict, List, Literal, NoReturn, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from fabriclite.checkpoint.checkpoint_io import CheckpointIO
from fabriclite.collectives import object_wire
from fabriclite.distributed import rendezvous
from fabriclite.distributed.control_plane import keys, meeting
from fabriclite.distributed.network import gloo_interface
from fabriclite.distributed import gloo_exit
from fabriclite.strategies import ddp_buckets
from fabriclite.strategies.base import copy_into
from fabriclite.strategies.parallel import ParallelStrategy
from fabriclite.supervision.agent.output_forwarding import prefixed_by_supervisor
from fabriclite.supervision.rank.collective_watch import CollectiveWatch

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "prod": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
#: all_gather into one flat output (``all_gather_into_tensor`` is deprecated from torch 2.13)
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
#: an out-of-place all_reduce of at least this many bytes runs in OVERLAP_CHUNKS chunks, each copied while
#: the previous ones are reduced (the copy that keeps the caller's tensor unchanged then costs little)
OVERLAP_BYTES = 4 << 20
OVERLAP_CHUNKS = 4


class DDPStrategy(ParallelStrategy):
    """Data-parallel over torch.distributed.

    ``start_method``: "popen" re-runs the script once per local rank (script mode), "spawn"/"fork"
    start ``launch(fn)``'s function in child processes. ``timeout``: argument > $FABRICLITE_TIMEOUT >
    30 min; it bounds every collective (a timeout is fatal for the group). Extra keyword arguments go
    to DistributedDataParallel (find_unused_parameters, static_graph, bucket_cap_mb, ...).
    """

    name = "ddp"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[None, float, timedelta] = None,
        start_method: StartMethod = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, checkpoint_io=checkpoint_io,
                         precision=precision, cluster_environment=cluster_environment)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r}; expected 'popen', 'spawn', 'fork' or 'forkserver'.")
        self.num_nodes = 1
        self.process_group_backend = process_group_backend
        self.timeout = rendezvous.resolve_timeout(timeout)
        self.start_method = start_method
        self.ddp_kwargs = ddp_kwargs
        self._store: Optional[dist.Store] = None
        self._groups: Dict[Tuple[int, ...], Any] = {}
        self._owns_group = False
        self._watch: Optional[CollectiveWatch] = None
        #: the DDP modules setup_module built, in order (their bucket layouts go into fabric.resume_state())
        self._ddp_modules: List["weakref.ReferenceType[DistributedDataParallel]"] = []
        #: (layout, strict) loaded before their module was set up, in set-up order
        self._pending_layouts: List[Tuple[Any, bool]] = []

    # ------------------------------------------------------------------ where this rank is
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices, "the connector sets parallel_devices"
        return self.parallel_devices[self.local_rank]

    @property
    def world_size(self) -> int:
        return self.cluster_environment.world_size() if self.cluster_environment else 1

    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.cluster_environment else 0

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self.cluster_environment else 0

    @property
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self.cluster_environment else 0

    def local_world_size(self) -> int:
        return self.num_processes

    @property
    def distributed_ready(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def store(self) -> Optional[dist.Store]:
        return self._store

    @property
    def launcher(self) -> Any:
        if self._launcher is None and self.cluster_environment is not None:
            if not self.cluster_environment.creates_processes_externally:
                from fabriclite.launchers import launcher_for

                self._launcher = launcher_for(self.start_method, self.cluster_environment, self.num_processes,
                                              self.num_nodes, self.timeout)
        return self._launcher

    # ------------------------------------------------------------------ set-up
    def setup_environment(self) -> None:
        super().setup_environment()
        if not self.distributed_ready:
            self._init_process_group()

    def _backend(self) -> str:
        if self.process_group_backend:
            return self.process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    def _init_process_group(self) -> None:
        env = self.cluster_environment
        rank, world = env.global_rank(), env.world_size()
        address, port = env.main_address, env.main_port
        if getattr(env, "uses_agent_store", False) or _torchelastic_agent_store():
            # behind the job secret's relay this node's ranks reach the store on loopback (supervision/agent/job_store.py)
            at = getattr(env, "store_endpoint", (address, port))
            store: dist.Store = rendezvous.join_store(at[0], at[1], self.timeout)
            store = meeting.round_store(store, int(os.environ.get(rendezvous.ROUND_ENV, "0") or 0))
            if _torchelastic_agent_store():  # one store for every round; the agents' restart counts may differ
                store = dist.PrefixStore(meeting.launch_namespace(store, rank, world, self.timeout), store)
        elif rank == 0:
            store = rendezvous.host_store(address, port, self.timeout)
        else:
            store = rendezvous.join_store(address, port, self.timeout)
        if rank == 0 and getattr(env, "name", "") != "fabriclite" and not rendezvous.is_loopback_name(address):
            warnings.warn(open_store_warning(env, address, port), UserWarning, stacklevel=2)
        self._store = dist.PrefixStore(keys.PREFIX, store)
        meeting.wait_for_ranks(self._store, keys.ARRIVED, rank, world, self.timeout, where=f"{address}:{port}")
        backend = self._backend()
        kwargs: Dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = self.root_device
        elif backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            interface = gloo_interface(address)  # this host's name resolves to loopback (Debian's 127.0.1.1)
            if interface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        excepthook = sys.excepthook
        dist.init_process_group(backend, store=dist.PrefixStore(keys.PROCESS_GROUP_PREFIX, store), rank=rank,
                                world_size=world, timeout=self.timeout, **kwargs)
        if prefixed_by_supervisor():  # lines carry "[rank N]" already: no "[rankN]:" from torch's excepthook
            sys.excepthook = excepthook
        self._owns_group = True
        self._start_watch(rank, world)

    def _start_watch(self, rank: int, world: int) -> None:
        """Count collectives and publish the counts (see supervision.rank.collective_watch), so that a timed-out or
        broken collective names the ranks that did not arrive."""
        assert self._store is not None
        try:
            publish_store = self._store.clone()
            publish_store.set_timeout(timedelta(seconds=10))  # never hold up a rank's exit for long
        except (AttributeError, RuntimeError):
            publish_store = self._store
        self._watch = CollectiveWatch(self._store, rank, world, self.timeout.total_seconds(), publish_store)
        self._watch.start()
        if self._backend() == "nccl":
            self._watch.mark_nccl()  # a hang's summary points at NCCL's flight recorder

    def _call(self, name: str, fn: Any, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        """Run collective ``fn``; a timeout or lost peer raises CollectiveTimeout / PeerLost naming
        the collective and the ranks that did not arrive (the group is unusable afterwards)."""
        watch = self._watch
        if watch is None:
            return fn(*args, group=group, **kwargs)
        key, number = watch.enter(name, group, dist.get_process_group_ranks)
        try:
            result = fn(*args, group=group, **kwargs)
        except RuntimeError as err:
            _failed(watch, name, key, number, err)
        watch.finished(name, number)
        return result

    def _call_async(self, name: str, fn: Any, *args: Any, group: Any = None, **kwargs: Any) -> Callable[[], None]:
        """Start collective ``fn`` (``async_op=True``); returns a function that waits for it, raising as
        ``_call`` does."""
        watch = self._watch
        key, number = watch.enter(name, group, dist.get_process_group_ranks) if watch is not None else ((), 0)
        try:
            work = fn(*args, group=group, async_op=True, **kwargs)
        except RuntimeError as err:
            _failed(watch, name, key, number, err)

        def wait() -> None:
            try:
                work.wait()
            except RuntimeError as err:
                _failed(watch, name, key, number, err)
            if watch is not None:
                watch.finished(name, number)
        return wait

    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        self._ddp_modules.append(weakref.ref(ddp))
        if self._pending_layouts:  # fabric.load ran before this setup
            layout, strict = self._pending_layouts.pop(0)
            if layout is not None:
                ddp_buckets.apply(ddp, layout, strict)
        return ddp

    # ------------------------------------------------------------------ gradient buckets, for exact resume
    def records_bucket_layout(self) -> bool:
        """Whether ``bucket_layout()`` records DDP's rebuilt gradient buckets for a bit-exact resume (plain DDP,
        unless switched off; see fabriclite.strategies.ddp_buckets)."""
        return ddp_buckets.enabled() and ddp_buckets.unsupported(self.ddp_kwargs) is None

    def _live_modules(self) -> List[DistributedDataParallel]:
        """The DDP modules setup_module built that are still alive, in set-up order."""
        live = [(ref, ref()) for ref in self._ddp_modules]
        self._ddp_modules = [ref for ref, ddp in live if ddp is not None]
        return [ddp for _, ddp in live if ddp is not None]

    def bucket_layout(self) -> Optional[List[Optional[ddp_buckets.Layout]]]:
        """The gradient bucket layout of every live DDP module set up, in set-up order (None for one with none to
        record yet), or None when recording is off or nothing was set up. A collective: call on every rank."""
        modules = self._live_modules()
        if not self.records_bucket_layout() or not modules:
            return None
        return [ddp_buckets.record(ddp) for ddp in modules]

    def apply_bucket_layout(self, layouts: Optional[List[Any]], strict: bool = True) -> None:
        """Hand recorded layouts (``bucket_layout()`` of the saved run) to the live DDP modules in set-up order;
        layouts beyond them go to the next modules set up. Nothing when recording is off. ``strict=False``: a layout
        that does not fit its module is skipped with a warning (else ValueError). A collective: call on every
        rank."""
        if layouts is None or not ddp_buckets.enabled():
            return
        if not isinstance(layouts, (list, tuple)):
            raise ValueError(f"the checkpoint's DDP bucket layouts are {layouts!r}; expected a list, one entry per "
                             f"module set up (written by fabric.resume_state()).")
        modules = self._live_modules()
        self._pending_layouts = [(layout, strict) for layout in layouts[len(modules):]]
        for ddp, layout in zip(modules, layouts):
            if layout is not None:
                ddp_buckets.apply(ddp, layout, strict)

    def get_module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        """The state_dict of the module under DDP (keys without the ``module.`` prefix)."""
        return super().get_module_state_dict(module.module if isinstance(module, DistributedDataParallel) else module)

    def load_module_state_dict(self, module: nn.Module, state_dict: Dict[str, Any], strict: bool = True) -> None:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        super().load_module_state_dict(module, state_dict, strict=strict)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """DDP's ``no_sync()``: gradients accumulate locally until a backward outside the block."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(f"no_backward_sync needs the module returned by setup(); got {type(module).__name__}.")
        return module.no_sync()

    def teardown(self) -> None:
        """Wait for checkpoints still being written (their background work uses the process groups), then leave
        the group; an asynchronous save's error is raised after the rest of the teardown."""
        try:
            self.wait_for_checkpoints()
        finally:
            if self._watch is not None:
                self._watch.stop()
                self._watch = None
            if dist.is_initialized() and "gloo" in str(dist.get_backend()):
                gloo_exit.wait_for_idle_workers()  # else a worker's late release can abort the rank at exit
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group()
            self._owns_group = False
            self._groups.clear()
            self._ddp_modules.clear()
            self._pending_layouts.clear()
            self._store = None
            super().teardown()

    # ------------------------------------------------------------------ primitives
    def resolve_group(self, group: Any) -> Any:
        if group is None or not isinstance(group, (list, tuple, range)):
            return group
        ranks = tuple(sorted(int(r) for r in group))
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"group={list(group)!r}: expected distinct ranks in 0..{self.world_size - 1}.")
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
        return self._groups[ranks]

    def group_size(self, group: Any = None) -> int:
        return dist.get_world_size(group)

    def group_rank(self, group: Any = None) -> int:
        return dist.get_rank(group)

    def group_ranks(self, group: Any = None) -> List[int]:
        if group is None:
            return list(range(dist.get_world_size()))
        return dist.get_process_group_ranks(group)

    def flat_all_reduce(self, tensor: Tensor, op: str = "sum", group: Any = None) -> Tensor:
        self._call("all_reduce", dist.all_reduce, tensor, op=_OPS[op], group=group)
        return tensor

    def flat_all_reduce_copy(self, out: Tensor, tensor: Tensor, op: str = "sum", group: Any = None,
                        divisor: Optional[int] = None) -> Tensor:
        """Chunked when large: chunk k is copied while chunks before it are reduced (gloo and NCCL run
        them in order on their own threads / stream), so the copy mostly hides behind the reduction."""
        if out.numel() * out.element_size() < OVERLAP_BYTES:
            return super().flat_all_reduce_copy(out, tensor, op, group, divisor)
        waits = []
        for part, source in zip(out.chunk(OVERLAP_CHUNKS), tensor.reshape(-1).chunk(OVERLAP_CHUNKS)):
            copy_into(part, source, divisor)
            waits.append(self._call_async("all_reduce", dist.all_reduce, part, op=_OPS[op], group=group))
        for wait in waits:
            wait()
        return out

    def flat_all_gather(self, tensor: Tensor, group: Any = None) -> Tensor:
        return self.flat_all_gather_into(tensor.new_empty((dist.get_world_size(group), *tensor.shape)), tensor, group)

    def flat_all_gather_into(self, out: Tensor, tensor: Tensor, group: Any = None) -> Tensor:
        # the concatenated (size * numel,) output form: the only one every backend accepts (gloo in
        # torch >= 2.13 rejects a stacked (size, *shape) output)
        self._call("all_gather", _ALL_GATHER_FLAT, out.view(-1), tensor.reshape(-1).contiguous(), group=group)
        return out

    def flat_all_gather_into_async(self, out: Tensor, tensor: Tensor, group: Any = None) -> Callable[[], Tensor]:
        """``flat_all_gather_into`` started; returns the function that waits for it (raising as ``_call`` does)
        and returns ``out``, so that the caller can work while the backend moves the data."""
        wait = self._call_async("all_gather", _ALL_GATHER_FLAT, out.view(-1), tensor.reshape(-1).contiguous(),
                                group=group)

        def done() -> Tensor:
            wait()
            return out
        return done

    def flat_broadcast(self, tensor: Tensor, src: int = 0, group: Any = None) -> Tensor:
        self._call("broadcast", dist.broadcast, tensor, src, group=group)
        return tensor

    def all_gather_object(self, obj: Any, group: Any = None) -> List[Any]:
        """Every member's ``obj``, loaded with fabriclite's restricted unpickler (``collectives.object_wire``)."""
        return object_wire.all_gather_objects(obj, lambda t: self.flat_all_gather(t, group), self._object_device())

    def broadcast_object(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        """``src``'s ``obj`` (a global rank), loaded with fabriclite's restricted unpickler on the others."""
        return object_wire.broadcast_object(obj, self.global_rank == src, lambda t: self.flat_broadcast(t, src, group),
                                            self._object_device())

    def barrier(self, name: Optional[str] = None, group: Any = None) -> None:
        if self._backend() == "nccl":
            self._call("barrier", dist.barrier, group=group, device_ids=[self.root_device.index])
        else:
            self._call("barrier", dist.barrier, group=group)

    def _object_device(self) -> torch.device:
        return self.root_device if self._backend() == "nccl" else torch.device("cpu")


def open_store_warning(env: Any, address: str, port: int) -> str:
    """The one warning of a job met through a launcher's store that fabriclite does not guard (torchrun, srun,
    mpirun: docs/security.md)."""
    return (f"fabriclite: this job's store at {address}:{port} is the {getattr(env, 'name', 'launcher')} launcher's "
            f"and accepts anyone who can reach it (no job secret guards it); run on a private network, or start the "
            f"job with `fabriclite run --job-secret-file FILE` (docs/security.md)")


def _torchelastic_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _failed(watch: Optional[CollectiveWatch], name: str, key: Tuple[int, ...], number: int,
            err: RuntimeError) -> NoReturn:
    """Raise the clear error for a timed-out or broken collective, else ``err`` itself."""
    error = watch.failed(name, key, number, err) if watch is not None else None
    if error is None:
        raise err
    raise error from None  # the backend's error is error.original
