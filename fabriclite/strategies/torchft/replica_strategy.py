"""Live recovery on torchft: ``fabriclite run --fault-tolerant`` (or ``Fabric(strategy="fault_tolerant")`` in a
script started that way). Each node is one torchft replica group; torchft's Manager, lighthouse, process group,
DDP and optimizer wrappers and checkpoint transport do the work (fabriclite.strategies.torchft.replica_parts).

What spans what, in this mode:

- ``world_size`` / ``global_rank`` / ``is_global_zero`` and ``fabric.all_reduce`` / ``barrier`` / ``broadcast`` /
  ``check_preempted`` span this node's replica group only (one rank per node today). torchft's cross-group
  all-reduce is reserved for the gradients: an error in it fails the step's commit, so a metrics reduce never
  goes through it.
- The gradient all-reduce spans every group in the current quorum (torchft's DDP); ``optimizer.step()`` steps
  only when the quorum commits, and returns whether it did.
- Data: ``distributed_sampler_kwargs`` shard by replica group, then by rank inside the group; while a group is
  down its shard for those steps is not trained on.
- Healing: ``fabric.load_latest(dir, state)`` registers ``state`` with the Manager and takes part in a quorum; a
  group behind a live peer receives the peer's ``state`` over the network (see :meth:`heal`).
- A job starts together: ``load_latest``'s quorum, when no group has committed a step yet (the job's first), must
  hold every group started with the job (``--num-nodes``); one that lacks some asks again once the missing
  groups heartbeat at the lighthouse, for up to ``--first-quorum-timeout`` seconds, then fails naming them
  (:meth:`FaultTolerantStrategy.first_quorum_incomplete`). Every group thus starts from group 0's initial state
  (torchft's ``init_sync``), and none trains alone while the others start. After that first quorum the quorum
  may shrink to ``--min-replicas`` groups.

torchft is imported only when the Manager is built (the first ``setup`` or ``load_latest``).
"""
from __future__ import annotations

import importlib.util
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

from torch import nn
from torch.optim import Optimizer

from fabriclite.strategies.ddp import DDPStrategy
from fabriclite.supervision.lighthouse import FT_EXTRA, LiveOptions, group_of, ranks_mismatch, status_groups

#: the Manager's timeout for one step's cross-group work (all-reduce, commit vote, a heal's transfer)
STEP_TIMEOUT = timedelta(seconds=60)
#: how long a Manager waits to connect to the lighthouse or a peer's manager
CONNECT_TIMEOUT = timedelta(seconds=10)
#: how often load_latest asks for a quorum again when a heal failed (the peer died while sending)
HEAL_ATTEMPTS = 5
#: the pause before a job's first quorum is asked again (below the lighthouse's join timeout, 300 ms: a group
#: that asked meanwhile is still waiting for this one)
FIRST_QUORUM_RETRY_S = 0.05
#: how often the missing groups' heartbeats are looked for on the lighthouse's status page
HEARTBEAT_POLL_S = 0.2
#: set in the group's store (this round's prefix) by group rank 0 once its Manager has written ``manager_addr``
MANAGER_UP_KEY = "torchft_manager_up"


class FaultTolerantStrategy(DDPStrategy):
    """One torchft replica group per node (see the module docstring). Runs only in ranks started by
    ``fabriclite run --fault-tolerant`` (``check_configuration`` raises ValueError elsewhere)."""

    #: the optimizer's ``zero_grad`` (the step's quorum) and ``step`` (the commit vote) wait on the other groups:
    #: the supervisor's hang and straggler watches count them as waits (supervision/rank/progress.py)
    waits_in_optimizer = True

    name = "fault_tolerant"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("start_method", "popen")
        super().__init__(**kwargs)
        self.options: Optional[LiveOptions] = None
        self._manager: Any = None
        self._state_registered = False
        #: load_latest's quorum is the first step's: the next zero_grad must not start another
        self._quorum_open = False

    # ------------------------------------------------------------------ set-up
    def check_configuration(self, accelerator: str, world_size: int) -> None:
        """ValueError at ``Fabric(...)``, before anything starts: torchft missing, not started by ``fabriclite run
        --fault-tolerant``, or more than one rank per node."""
        if importlib.util.find_spec("torchft") is None:
            raise ValueError(f"strategy={self.name!r} needs torchft, which is not installed: {FT_EXTRA}.")
        self.options = LiveOptions.from_env()
        if self.options is None:
            raise ValueError(f"strategy={self.name!r} runs in a script started by `fabriclite run --fault-tolerant "
                             "--num-nodes N --node-rank I ...` (each node one replica group); start it that way.")
        if world_size != 1 and not self.groups_of_several_ranks:
            raise ValueError(f"strategy={self.name!r} runs one rank per replica group for now (groups of several "
                             f"ranks run strategy='fault_tolerant', DDP inside the group); got {world_size} ranks "
                             f"per group here (--devices). Use devices=1.")

    #: whether a replica group may run several ranks (DDP inside the group): the per-step path yes; DiLoCo and
    #: LocalSGD not yet
    groups_of_several_ranks = True

    @property
    def replica_group(self) -> int:
        """This rank's replica group (its node rank under ``fabriclite run --fault-tolerant``); ``global_rank`` is
        the rank inside that group."""
        return self.options.group if self.options else 0

    @property
    def num_replica_groups(self) -> int:
        """The number of replica groups the job started with (``--num-nodes``); each runs ``world_size`` ranks
        (``--devices``)."""
        return self.options.groups if self.options else 1

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, int]:
        """Shard by replica group, then by rank inside the group."""
        groups, group = (self.options.groups, self.options.group) if self.options else (1, 0)
        return {"num_replicas": groups * self.world_size, "rank": group * self.world_size + self.global_rank}

    @property
    def manager(self) -> Any:
        """This group's torchft Manager, built on first use (after torch._dynamo is imported, so that its
        heartbeats start just before its first quorum)."""
        if self._manager is None:
            if self.options is None:
                raise RuntimeError("fault_tolerant: call fabric.launch() (or start under `fabriclite run "
                                   "--fault-tolerant`) before setup() or load_latest().")
            self._check_ranks_per_group()
            if self.world_size > 1 and self.global_rank > 0:  # rank 0's Manager has written this round's address
                self._wait_for_group_manager()
            self._manager = self.new_manager()
            if self.world_size > 1 and self.global_rank == 0:
                assert self._store is not None
                self._store.set(MANAGER_UP_KEY, "1")
        return self._manager

    def _check_ranks_per_group(self) -> None:
        """RuntimeError, naming both numbers, when a live group (heartbeating at the lighthouse) runs another number
        of ranks per group than this one: a node that came back with fewer or more devices never joins a quorum
        (its rank r would have no peer, and the live groups' rank r would wait for it)."""
        host, port = self.options.host_port
        alive = status_groups(host, port) or []
        mismatch = ranks_mismatch([replica_id.split(":")[0] for replica_id in alive], self.options.group,
                                  self.world_size)
        if mismatch:
            raise RuntimeError(mismatch)

    def _wait_for_group_manager(self) -> None:
        """Wait until this group's rank 0 has started this round's ManagerServer. torchft's Manager on rank r > 0
        reads ``manager_addr`` from the group's store, which outlives the ranks (the supervisor's): a rank of a
        restarted group reading it before rank 0 wrote the new one would get the dead round's address and never
        connect (the stale-key trap). The key waited for is this round's (the store's round prefix)."""
        assert self._store is not None
        self._store.wait([MANAGER_UP_KEY], self.timeout)

    def new_manager(self) -> Any:
        """The Manager of the per-step path: an asynchronous quorum, overlapped with the forward pass."""
        return self._build_manager()

    def _build_manager(self, **kwargs: Any) -> Any:
        env = self.cluster_environment
        return _parts().build_manager(
            self.options, self.global_rank, self.world_size, env.main_address, env.main_port,
            timeout=min(self.timeout, STEP_TIMEOUT), quorum_timeout=self.timeout,
            connect_timeout=min(self.timeout, CONNECT_TIMEOUT), **kwargs)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """torchft's DDP: gradients are averaged across the replica groups of the step's quorum (one rank per group);
        with several ranks per group, DDP over the group's ranks whose buckets then cross the groups
        (replica_parts.GroupDDP): the mean over every rank of every group in the quorum."""
        if self.world_size > 1:
            return _parts().GroupDDP(self.manager, module)
        return _parts().ReplicaDDP(self.manager, module)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """torchft's optimizer wrapper: ``zero_grad`` starts the step's quorum, ``step`` steps only when the
        quorum commits and returns whether it did. No closures."""
        return _parts().ReplicaOptimizer(self.manager, optimizer, self.start_step)

    def start_step(self) -> None:
        """Start this step's quorum, unless ``load_latest`` already did (its quorum is this step's)."""
        if not self._state_registered:
            raise RuntimeError("under --fault-tolerant, call fabric.load_latest(checkpoint_dir, state) before the "
                               "first optimizer.zero_grad(): that state (model, optimizer, step, ...) is what a "
                               "group that comes back receives from a live peer.")
        if self._quorum_open:
            self._quorum_open = False
            return
        self.manager.start_quorum()

    # ------------------------------------------------------------------ healing
    def heal(self, state_fn: Callable[[], Dict[str, Any]], apply_fn: Callable[[Dict[str, Any]], None]) -> int:
        """Register the script's state with the Manager (``state_fn()``: it as saved, taken on torchft's quorum
        thread, so it must not communicate; ``apply_fn(d)``: restore it) and take part in a quorum. A live
        peer ahead of this group sends its state, which is applied before this returns. Returns the step the
        live groups have committed (0: none has, the job is starting or every group died: read the disk).
        RuntimeError if the state could not be received after HEAL_ATTEMPTS quorums."""
        manager = self._register_state(lambda: plain_tensors(state_fn()), apply_fn)
        deadline = self.first_quorum_deadline()
        failures = 0
        while failures < HEAL_ATTEMPTS:
            manager.start_quorum()
            healed = _parts().finish_heal(manager)
            failed = not (healed or manager.errored() is None)
            again = failed or self.first_quorum_incomplete(manager, deadline)
            if self.world_size > 1:  # the group's ranks ask again together, or go on together
                failed, again = self._group_any(failed), self._group_any(again)
            if failed:
                failures += 1
            if again:
                continue
            if self.world_size > 1:
                self._check_healed_together(manager)
                if manager.current_step() == 0:
                    self._share_initial_state(state_fn, apply_fn)
            self._quorum_open = True
            return manager.current_step()
        raise self._heal_failed()

    def _share_initial_state(self, state_fn: Callable[[], Dict[str, Any]],
                             apply_fn: Callable[[Dict[str, Any]], None]) -> None:
        """At the job's first quorum (step 0): every rank of this group takes group rank 0's state (a broadcast
        inside the group). torchft's ``init_sync`` heals each group rank on its own, and at step 0 two ranks of one
        group may take it from different groups (measured: group 0's rank 1 healed from group 1's rank 1), which
        would leave the ranks of one DDP group apart from the first step; group rank 0's state is group 0's
        rank 0's. Later heals need none of this: the live groups' ranks hold one state (DDP inside)."""
        received = self.broadcast_object(state_fn() if self.global_rank == 0 else None, src=0)
        if self.global_rank != 0:
            apply_fn(received)

    def _group_any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of this replica group (an all-reduce inside the group)."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _check_healed_together(self, manager: Any) -> None:
        """After a quorum: the group's ranks hold one step and one quorum id (an all-reduce inside the group), else
        RuntimeError naming both (the group fails and restarts as a whole; its ranks never step apart)."""
        import torch
        import torch.distributed as dist

        mine = [manager.current_step(), manager._quorum_id]  # torchft 0.2.0's quorum id
        value = torch.tensor([mine[0], mine[1], -mine[0], -mine[1]], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        high, low = value[:2].tolist(), [-v for v in value[2:].tolist()]
        if high != low:
            raise RuntimeError(f"{self.name}: the ranks of replica group {self.replica_group} came out of one quorum "
                               f"at different steps or quorums (steps {low[0]}..{high[0]}, quorum ids "
                               f"{low[1]}..{high[1]}; group rank {self.global_rank} at step {mine[0]}, quorum "
                               f"{mine[1]}): the group restarts rather than step apart.")

    def first_quorum_deadline(self) -> float:
        """When (time.monotonic) the job's first quorum stops waiting for the groups started with it."""
        return time.monotonic() + (self.options.first_quorum_timeout if self.options else 0.0)

    def first_quorum_incomplete(self, manager: Any, deadline: float) -> bool:
        """Whether the quorum just formed is the job's first (no group has committed a step) and lacks a group
        started with the job: then wait until every missing group heartbeats at the lighthouse (it is up and about
        to ask) and return True (ask again). False for a complete quorum or one of a running job. RuntimeError
        naming the missing groups once ``deadline`` has passed."""
        step, present = manager.quorum_groups()
        groups = self.options.groups if self.options else 1
        missing = [g for g in range(groups) if g not in present]
        if step > 0 or not missing:
            return False
        host, port = self.options.host_port
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise RuntimeError(
                    f"{self.name}: the job's first quorum did not hold every replica group within "
                    f"--first-quorum-timeout {self.options.first_quorum_timeout:g} s: group(s) "
                    f"{', '.join(map(str, missing))} of {groups} (--num-nodes) never joined (the quorum held "
                    f"group(s) {', '.join(map(str, present)) or 'none'}). Start the missing nodes (`fabriclite run "
                    f"--fault-tolerant --num-nodes {groups} --node-rank I ...`, each reaching the lighthouse at "
                    f"{self.options.lighthouse}), or raise --first-quorum-timeout.")
            alive = status_groups(host, port)
            if alive is None:  # the status page does not answer: ask again after a pause
                break
            heartbeating = {group_of(replica_id.split(":")[0]) for replica_id in alive}
            if all(g in heartbeating for g in missing):
                break
            time.sleep(min(HEARTBEAT_POLL_S, max(0.0, deadline - now)))
        time.sleep(FIRST_QUORUM_RETRY_S)
        return True

    def _register_state(self, state_fn: Callable[[], Dict[str, Any]],
                        apply_fn: Callable[[Dict[str, Any]], None]) -> Any:
        """The Manager, with the script's state registered once (what a live peer sends a group that heals)."""
        manager = self.manager
        if not self._state_registered:
            manager.register_state_dict_fn("fabriclite", apply_fn, state_fn)
            self._state_registered = True
        return manager

    def _heal_failed(self) -> RuntimeError:
        return RuntimeError(f"{self.name}: {HEAL_ATTEMPTS} quorums in a row failed to deliver a live peer's state to "
                            f"replica group {self.options.group if self.options else '?'}; last error: "
                            f"{self.manager.errored()}")

    def teardown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None
        super().teardown()


def plain_tensors(value: Any) -> Any:
    """``value`` (a state dict, nested) with every ``nn.Parameter`` replaced by a plain tensor over the same storage
    (``.detach()``): torchft's PGTransport refuses Parameters in the state it sends a healing group (the Parameter
    trap); a module's ``state_dict()`` holds none, but a script's own entries may."""
    if isinstance(value, nn.Parameter):
        return value.detach()
    if isinstance(value, dict):
        return {k: plain_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(plain_tensors(v) for v in value)
    return value


def _parts() -> Any:
    """fabriclite.strategies.torchft.replica_parts (imports torchft); ImportError naming the extra when it is
    missing."""
    try:
        from fabriclite.strategies.torchft import replica_parts
    except ImportError as err:
        if "torchft" not in str(err):
            raise
        raise ImportError(f"strategy='fault_tolerant' needs torchft: {FT_EXTRA}.") from err
    return replica_parts
