"""torchft's parts as the fault_tolerant strategy uses them. Importing this module imports torchft (pinned to
0.2.0 by the ``fabriclite[ft]`` extra); only the strategies of ``fabriclite.strategies.torchft`` import it, on first
use.

Fixes of torchft 0.2, each the smallest subclass or setting that works (their measured effect per step:
benchmarks/results/fault_tolerance.md, benchmarks/ft_cuts.py):

- :class:`ReplicaDDP`'s comm hook sends the bucket on the Manager's process group (a sum, then a division by the
  quorum's group count, as torchft's ``Manager.allreduce``) and returns the all-reduce's own future. torchft's hook
  waited for each bucket inside the hook (no overlap of the all-reduce with the rest of backward), through a
  managed work, a chain of futures and a timeout registered on a separate asyncio thread (woken twice a bucket;
  gloo's own timeout, the Manager's, bounds the all-reduce here). And when a peer dies inside the all-reduce,
  gloo raises in the wait: torchft's managed work recorded the error but left its inner future unset, and its
  comm hook asserted on it, so every survivor crashed. Here the error is recorded on the Manager, the future
  completes with the bucket as it is, the step is not committed and the script retries it.
- :func:`plain_bucket_caps`: torchft's DDP keeps DDP's constructor buckets (``find_unused_parameters=True``
  never rebuilds them), which put a large gradient in the bucket that waits for the first layer's; ReplicaDDP
  asks for plain DDP's (rebuilt) layout instead, so the large all-reduce overlaps with the rest of backward.
- :class:`ReplicaManager`: with one rank per replica group (what the strategy runs), ``should_commit`` takes
  the group's vote locally instead of an RPC to the group's own ManagerServer, whose answer is that vote; and it
  keeps the last quorum's result (:attr:`ReplicaManager.last_quorum`: which groups it held, their highest step),
  which torchft's Manager reads and drops, so that the strategy can tell a job's first quorum that lacks groups.
- :func:`build_manager` imports ``torch._dynamo`` (which torchft's DDP wrapper imports lazily, ~1 s) before the
  Manager starts heartbeating, and uses the process-group checkpoint transport (torchft's HTTP transport
  advertises ``gethostname()``, which maps to 127.0.1.1 on Debian hosts, and binds IPv6 only).
"""
# no ``from __future__ import annotations``: DDP checks the comm hook's annotations as objects
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch._dynamo  # noqa: F401 - see build_manager
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllreduceOptions
from torch.optim import Optimizer
from torchft.checkpointing.pg_transport import PGTransport
from torchft.ddp import DistributedDataParallel
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from fabriclite.supervision.lighthouse import LiveOptions, group_of, ranks_mismatch, replica_name


def build_manager(options: LiveOptions, group_rank: int, group_world_size: int, store_address: str,
                  store_port: int, timeout: timedelta, quorum_timeout: timedelta,
                  connect_timeout: timedelta, manager_class: Optional[type] = None,
                  use_async_quorum: bool = True) -> "Manager":
    """This replica group's Manager: its store is the group's own (``store_address:store_port``, hosted by the
    node's supervisor at the node's advertised address), its replica id ``group_<node rank>``, and a heal's
    state travels over the cross-group gloo process group. ``init_sync``: every group starts from group 0's
    initial state (the others heal from it at step 0). ``manager_class`` (default :class:`ReplicaManager`) and
    ``use_async_quorum``: what the low-communication strategies change (fabriclite.strategies.torchft.diloco_sync)."""
    pg = ProcessGroupGloo(timeout=timeout)
    transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
    return (manager_class or ReplicaManager)(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=options.min_replicas,
        use_async_quorum=use_async_quorum,
        timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=connect_timeout, rank=group_rank,
        world_size=group_world_size, store_addr=store_address, store_port=store_port,
        lighthouse_addr=f"http://{options.lighthouse}", replica_id=replica_name(options.group, group_world_size),
        hostname=options.address, checkpoint_transport=transport, init_sync=True, group=options.group,
    )


def finish_heal(manager: Manager) -> bool:
    """Wait for the quorum ``manager.start_quorum()`` began; if this group was behind, apply the state a peer
    sent (the Manager's registered load function) now, on this thread, instead of in the step's commit.
    Whether a state was applied. The group still takes no part in this step's gradient (it was not at the
    quorum's step when the quorum formed), exactly as torchft's own asynchronous heal."""
    manager.wait_quorum()
    if not manager._healing:  # torchft 0.2.0's flag: set by the quorum when this group must heal
        return False
    if manager._pending_state_dict is None:  # the transfer failed: the error is recorded, try another quorum
        return False
    manager._apply_pending_state_dict()
    manager._healing = False  # applied: the step's commit must not apply it again
    return True


class _RecordingClient:
    """torchft's ManagerClient, keeping each quorum result on the Manager (``last_quorum``)."""

    def __init__(self, client: Any, manager: "ReplicaManager") -> None:
        self._client, self._manager = client, manager

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self._manager.last_quorum = result
        manager = self._manager
        mismatch = ranks_mismatch(list(result.replica_ids), manager.group, manager._group_world_size)
        if mismatch:  # before the cross-group process groups are configured: they would wait for absent ranks
            raise RanksPerGroupMismatch(mismatch)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class RanksPerGroupMismatch(RuntimeError):
    """A quorum held replica groups of different numbers of ranks (the message names both numbers)."""


class ReplicaManager(Manager):
    """torchft's Manager; with one rank per replica group, ``should_commit`` decides locally; the last quorum's
    result is kept (module docstring); a quorum whose groups run different numbers of ranks raises
    :class:`RanksPerGroupMismatch` (on the quorum thread: ``wait_quorum`` raises it) instead of configuring process
    groups that would wait for ranks that do not exist."""

    def __init__(self, *args: Any, group: int = 0, **kwargs: Any) -> None:
        #: this replica group's number (its node rank)
        self.group = group
        super().__init__(*args, **kwargs)
        #: the last quorum's result (torchft's QuorumResult: ``replica_ids``, ``max_step``, ...), None before one
        self.last_quorum: Any = None
        self._client = _RecordingClient(self._client, self)

    def quorum_groups(self) -> Tuple[int, List[int]]:
        """The last quorum's highest committed step and the groups (node ranks) it held, sorted; call after
        ``wait_quorum``."""
        if self.last_quorum is None:
            return 0, []
        groups = {group_of(replica_id.split(":")[0]) for replica_id in self.last_quorum.replica_ids}
        return self.last_quorum.max_step, sorted(g for g in groups if g is not None)

    def should_commit(self, timeout: Optional[timedelta] = None) -> bool:
        """Whether this step commits (a quorum of at least ``min_replica_size`` groups and no error recorded); as
        torchft's, but a group of one rank takes its own vote instead of sending it to its ManagerServer and
        waiting for the answer (the server's vote only gathers the group's ranks: with one, it returns the vote)."""
        if self._group_world_size != 1 or torch.accelerator.is_available():
            return super().should_commit(timeout)
        participants = 0  # no quorum started (no zero_grad before this step): torchft's count, no commit
        if self._quorum_future is not None:
            self._quorum_future.result()
            participants = self._participating_replica_world_size
        if err := self._pg.errored():
            self.report_error(err)
        if self._healing:
            self._apply_pending_state_dict()
        should_commit = participants >= self._min_replica_size and self._errored is None
        self._checkpoint_transport.disallow_checkpoint()
        if should_commit:
            self._step += 1
            self._batches_committed += participants
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                raise RuntimeError(f"should_commit failed {self._commit_failures} times consecutively, exceeding "
                                   f"max_retries={self._max_retries}")
        return should_commit


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


#: plain DDP's bucket size limits (torch's defaults): the first bucket, then the others
FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 * 2**20


def plain_bucket_caps(module: nn.Module) -> List[float]:
    """Per-bucket size limits (MiB, DDP's ``bucket_cap_mb_list``) that give the buckets plain DDP ends up with
    after its first step, for gradients that become ready in reverse parameter order (the usual case): filled
    from the last parameter on, each closed once it holds at least 1 MiB (the first) or 25 MiB (the others).
    torchft's DDP runs with ``find_unused_parameters=True``, which keeps DDP's constructor buckets for good, and
    those are cut the other way round: on the 16-1024-1024-1 MLP the 4 MiB weight waited in the last bucket
    for the first layer's gradients, and its all-reduce could not overlap with the rest of backward."""
    sizes = [p.numel() * p.element_size() for p in reversed(list(module.parameters())) if p.requires_grad]
    buckets: List[int] = []
    filled, limit = 0, FIRST_BUCKET_BYTES
    for size in sizes:
        filled += size
        if filled >= limit:
            buckets.append(filled)
            filled, limit = 0, BUCKET_BYTES
    if filled:
        buckets.append(filled)
    # DDP assigns from the first parameter on, closing a bucket once it reaches its limit, and reverses the list:
    # a limit one byte under each bucket's size closes it at its last parameter
    return [(size - 1) / 2**20 for size in reversed(buckets)]


class ReplicaDDP(DistributedDataParallel):
    """torchft's DDP (gradients averaged across the quorum's groups) with its own comm hook and plain DDP's
    buckets (module docstring)."""

    def __init__(self, manager: Manager, module: nn.Module) -> None:
        super().__init__(manager, module, bucket_cap_mb_list=plain_bucket_caps(module))

    @staticmethod
    def _comm_hook(state: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket summed over the quorum's groups on the Manager's process group, then divided by their
        number (torchft's ``Manager.allreduce``: a group that is healing contributes zeros), returned as a
        future the reducer waits for at the end of backward. An error (a peer died inside the all-reduce) is
        recorded on the Manager, which then does not commit the step, and completes the future with the bucket
        as it is; once an error is recorded, later buckets are not sent."""
        return across_groups(state, bucket.buffer(), 1)


def across_groups(state: Manager, buffer: torch.Tensor, ranks_per_group: int) -> torch.futures.Future[torch.Tensor]:
    """``buffer`` (this rank's bucket, already summed over the ``ranks_per_group`` ranks of its replica group)
    summed over the quorum's groups on the Manager's process group (this group rank's: rank r of every group),
    then divided by the number of ranks that contributed (groups x ranks per group); a future of it. See
    :meth:`ReplicaDDP._comm_hook` for errors: they are recorded on the Manager, never raised."""
    if state._errored is not None:
        return _done(buffer)
    if state._quorum_future is None:
        raise RuntimeError("under --fault-tolerant, call optimizer.zero_grad() before the backward pass: it starts "
                           "the step's quorum, which the gradient all-reduce needs.")
    state._quorum_future.result()  # the quorum start_quorum began (raises as torchft's wait_quorum would)
    divisor = state._participating_replica_world_size * ranks_per_group
    if not state.is_participating():
        buffer.zero_()
    try:
        options = AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        work = state._pg.allreduce([buffer], options)
    except Exception as err:  # noqa: BLE001 - the process group is broken: the step must not commit
        state.report_error(err)
        return _done(buffer)

    def average(future: torch.futures.Future[Any]) -> torch.Tensor:
        try:
            future.wait()
        except Exception as err:  # noqa: BLE001 - a peer failed inside the all-reduce
            state.report_error(err)
            return buffer
        if divisor > 1:
            buffer.div_(divisor)
        return buffer

    return work.get_future().then(average)


class GroupDDP(nn.parallel.DistributedDataParallel):
    """DDP over a replica group of several ranks (torch's default process group: the group's ranks only), each
    bucket then crossing the groups through the Manager (:func:`across_groups`).

    - Inside the group every bucket is summed on every rank (a plain all-reduce, waited for in the hook), whatever
      the Manager's state: the group's ranks run the same collectives in the same order even when one of them has
      recorded a cross-group error (the group's commit vote, an AND over its ranks, then fails).
    - The bucket layout never changes: ``find_unused_parameters=True`` keeps DDP's constructor buckets (no rebuild
      after the first iteration), cut by :func:`plain_bucket_caps` to plain DDP's rebuilt layout. A rebuild would
      give a healed group (fresh DDP, constructor buckets) another layout than the live groups' (rebuilt) ones,
      and their bucket all-reduces would add up different gradients (the rebuilt-bucket trap).
    - DDP's constructor broadcasts group rank 0's parameters inside the group; torchft's ``init_sync`` then brings
      every group rank to group 0's (each group rank heals from the same group rank of a live group)."""

    def __init__(self, manager: Manager, module: nn.Module) -> None:
        super().__init__(module, find_unused_parameters=True, bucket_cap_mb_list=plain_bucket_caps(module))
        self.register_comm_hook(manager, self._comm_hook)

    @staticmethod
    def _comm_hook(state: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket summed inside the group (waited for), then across the groups and averaged over every rank
        (:func:`across_groups`; the group's ranks: the default process group's size)."""
        buffer = bucket.buffer()
        dist.all_reduce(buffer)  # raises when a rank of this group died: the group restarts as a whole anyway
        return across_groups(state, buffer, dist.get_world_size())


class ReplicaOptimizer(OptimizerWrapper):
    """torchft's optimizer wrapper: ``zero_grad`` calls ``start_step`` (the step's quorum), ``step`` steps only
    when the quorum commits and returns True then, else False (the gradients were dropped: a group failed)."""

    def __init__(self, manager: Manager, optimizer: Optimizer, start_step: Callable[[], None]) -> None:
        super().__init__(manager, optimizer)
        self._start_step = start_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._start_step()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> bool:  # type: ignore[override]
        if closure is not None:
            raise ValueError("under --fault-tolerant, optimizer.step(closure) is not supported (torchft's optimizer "
                             "wrapper commits once per step): compute the loss, call fabric.backward, then step().")
        if self.manager.should_commit():
            self.optim.step()
            return True
        return False
