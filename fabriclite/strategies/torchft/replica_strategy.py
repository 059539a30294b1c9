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
from fabriclite.supervision.lighthouse import FT_EXTRA, LiveOptions, group_of, status_groups

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
        if world_size != 1:
            raise ValueError(f"strategy={self.name!r} runs one rank per node (torchft 0.2's Manager reduces across "
                             f"nodes over one process group of one rank per group, not inside one); got {world_size} "
                             f"ranks here. Use devices=1.")

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
            self._manager = self.new_manager()
        return self._manager

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
        """torchft's DDP: gradients are averaged across the replica groups of the step's quorum."""
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
        manager = self._register_state(state_fn, apply_fn)
        deadline = self.first_quorum_deadline()
        failures = 0
        while failures < HEAL_ATTEMPTS:
            manager.start_quorum()
            healed = _parts().finish_heal(manager)
            if not (healed or manager.errored() is None):
                failures += 1
                continue
            if self.first_quorum_incomplete(manager, deadline):
                continue
            self._quorum_open = True
            return manager.current_step()
        raise self._heal_failed()

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
