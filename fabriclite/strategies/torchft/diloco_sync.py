"""torchft 0.2.0's LocalSGD and DiLoCo as the low-communication strategies use them
(fabriclite.strategies.torchft.diloco). Importing this module imports torchft; only that strategy imports it,
when the optimizer is set up.

- :class:`SyncManager`: fabriclite's Manager (one rank per group, synchronous quorum) whose commit vote also
  (a) averages the model's floating-point buffers over the quorum (torchft averages parameters only; BatchNorm
  statistics would drift apart per group), inside the vote, so a failed sync changes no buffer; and (b) refuses
  to commit a sync one of whose all-reduces failed or was issued under another quorum. torchft's DiLoCo says of
  its ``should_commit``: "This can return success even if the allreduce failed. Because the process group could
  have been reconfigured while the allreduce was inflight." Here each of the sync's all-reduces is waited for
  again (a completed one returns at once; a failed one records its error) and its quorum compared before the
  vote.
- :class:`DiLoCoSync` / :class:`LocalSGDSync`: torchft's classes, unchanged in what they compute, plus
  :meth:`join` (a group that was healed inside the live groups' sync quorum takes part in that sync, exactly as
  their step hook does) and their state for fabriclite's checkpoints; and :meth:`DiLoCoSync.check_end`: at the
  end of a run the groups compare their committed syncs and a checksum of their global weights (torchft's vote
  is per group, so a sync whose all-reduce failed in one group only commits in the others; the next sync's
  quorum heals the group behind, but after the last one nothing would).
"""
from __future__ import annotations

import zlib
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceOptions
from torch.optim import Optimizer
from torchft.local_sgd import DiLoCo, LocalSGD

from fabriclite.strategies.torchft.diloco_settings import Settings, fragments_of
from fabriclite.strategies.torchft.replica_parts import ReplicaManager


class SyncManager(ReplicaManager):
    """fabriclite's Manager for LocalSGD / DiLoCo (module docstring). ``buffers``: the tensors averaged at each
    commit vote (set by :func:`build`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffers: List[torch.Tensor] = []
        self._sync_works: List[Tuple[int, Any]] = []

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: ReduceOp = ReduceOp.AVG) -> Any:
        """torchft's fault-tolerant all-reduce, remembered (with its quorum) for the next commit vote."""
        work = super().allreduce(tensor, should_quantize=should_quantize, reduce_op=reduce_op)
        self._sync_works.append((self._quorum_id, work))
        return work

    def should_commit(self, timeout: Optional[timedelta] = None) -> bool:
        """Average the buffers, check every all-reduce of this sync, then vote (ReplicaManager's). The buffers take
        their averages only when the sync commits."""
        averages = self._average_buffers()
        self._check_sync_works()
        committed = super().should_commit(timeout)
        if committed:
            with torch.no_grad():
                for buffer, average in zip(self.buffers, averages):
                    buffer.copy_(average)
        return committed

    def _average_buffers(self) -> List[torch.Tensor]:
        if not self.buffers or self._errored is not None:
            return []
        copies = [buffer.detach().clone() for buffer in self.buffers]
        for work in [self.allreduce(copy) for copy in copies]:
            work.wait()
        return copies

    def _check_sync_works(self) -> None:
        works, self._sync_works = self._sync_works, []
        for quorum_id, work in works:
            if quorum_id != self._quorum_id:
                self.report_error(RuntimeError(f"the process group was reconfigured (quorum {quorum_id} -> "
                                               f"{self._quorum_id}) while a sync's all-reduce was in flight"))
            elif not work.wait():  # a failed work records its error on the Manager and returns False
                self.report_error(RuntimeError("a sync's all-reduce failed"))


class DiLoCoSync(DiLoCo):
    """torchft's DiLoCo (streaming with several fragments) with :meth:`join` and a checkpoint state."""

    def join(self) -> None:
        """Take part in the sync the live groups of the quorum just started (their step hook's work after its
        ``start_quorum``): prepare the current fragment, and with no delay perform it at once."""
        fragment = self._fragments[self._current_fragment()]
        self._local_step = self._sync_every - self._fragment_sync_delay
        fragment.prepare_sync()
        if self._local_step == self._sync_every:
            fragment.perform_sync()
            self._local_step = 0

    def state_dict(self) -> Dict[str, Any]:
        """The Manager's step (which fragment syncs next), the inner step inside the interval and, per fragment,
        torchft's own state (``original_parameters``: the global weights; ``outer_optimizer``)."""
        return {"scheme": "diloco", "manager": self._manager.state_dict(), "local_step": self._local_step,
                "fragments": [self._manager._user_state_dicts[_key(i)]() for i in range(len(self._fragments))]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s. A checkpoint taken while a fragment's all-reduce was in flight
        (``fragment_sync_delay > 0``) resumes one step before that fragment's sync starts again."""
        _check_scheme(state, "diloco")
        if len(state["fragments"]) != len(self._fragments):
            raise ValueError(f"the checkpoint holds {len(state['fragments'])} DiLoCo fragments; this run has "
                             f"fragments={len(self._fragments)}. Resume with the checkpoint's fragments.")
        self._manager.load_state_dict(state["manager"])
        for i, fragment in enumerate(state["fragments"]):
            self._manager._load_state_dict_fns[_key(i)](fragment)
        pending_from = self._sync_every - self._fragment_sync_delay
        self._local_step = min(state["local_step"], pending_from - 1)

    def global_checksum(self) -> int:
        """A CRC-32 of every fragment's global weights (``original_parameters``), in order, bytes as stored."""
        crc = 0
        for fragment in self._fragments:
            for name in sorted(fragment.original_parameters):
                tensor = fragment.original_parameters[name].detach()
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                crc = zlib.crc32(name.encode(), crc)
                crc = zlib.crc32(local.cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
        return crc

    def check_end(self, group: int, groups: int) -> List[int]:
        """At the end of a run: one more quorum (no heal: a group behind must not be hidden by one), then every
        group of it compares its committed syncs and :meth:`global_checksum` with the others' (one small
        all-reduce on the Manager's process group). RuntimeError naming the groups on a mismatch; the groups
        compared otherwise (this one alone when the others have already gone)."""
        manager = self._manager
        for _, work in manager._sync_works:  # a fragment's all-reduce still in flight (fragment_sync_delay)
            work.wait()
        manager._sync_works = []
        # torchft's start_quorum runs the quorum on the Manager's thread pool, which Python has already shut down
        # when this runs at exit (the strategy's teardown is an atexit handler): run it on this thread
        manager._errored, manager._healing = None, False
        manager._async_quorum(allow_heal=False, shrink_only=False, quorum_timeout=manager._quorum_timeout,
                              curr_device=-1)
        if manager.errored() is not None:
            raise RuntimeError(f"strategy='diloco': the end-of-run comparison of the replica groups' global "
                               f"weights could not form a quorum: {manager.errored()}")
        _, present = manager.quorum_groups()
        table = torch.zeros(groups, 3, dtype=torch.float64)  # per group: present, syncs committed, checksum
        table[group] = torch.tensor([1.0, float(manager.current_step()), float(self.global_checksum())],
                                    dtype=torch.float64)
        if len(present) > 1:
            options = AllreduceOptions()
            options.reduceOp = ReduceOp.SUM
            manager._pg.allreduce([table], options).wait()
        rows = {g: (int(table[g, 1]), int(table[g, 2])) for g in range(groups) if table[g, 0] == 1.0}
        if len(set(rows.values())) > 1:
            described = "; ".join(f"group {g}: {step} syncs committed, global weights CRC-32 {crc:08x}"
                                  for g, (step, crc) in rows.items())
            raise RuntimeError(f"strategy='diloco' ended with replica groups whose global weights differ ({described}). "
                               f"A sync committed in some groups and not in others (an all-reduce failed in one "
                               f"group only); resume every group from one group's checkpoint.")
        return sorted(rows)

    def close(self) -> None:
        self.__exit__(None, None, None)


class LocalSGDSync(LocalSGD):
    """torchft's LocalSGD with :meth:`join` and a checkpoint state."""

    def join(self) -> None:
        """Take part in the sync the live groups of the quorum just started (average the parameters)."""
        self._perform_sync()
        self._local_step = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"scheme": "local_sgd", "manager": self._manager.state_dict(), "local_step": self._local_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        _check_scheme(state, "local_sgd")
        self._manager.load_state_dict(state["manager"])
        self._local_step = state["local_step"]

    def close(self) -> None:
        self.__exit__(None, None, None)


def build(manager: SyncManager, module: nn.Module, optimizer: Optimizer, settings: Settings,
          fragments: Optional[List[nn.Module]] = None) -> Any:
    """The entered LocalSGD / DiLoCo context of ``settings.scheme`` (its hooks on ``optimizer.step``; DiLoCo, on
    ``fragments`` (default: :func:`fragments_of` the module), has copied the global weights and registered its
    fragments' state with the Manager)."""
    manager.buffers = [buffer for buffer in module.buffers() if buffer.is_floating_point()]
    if settings.scheme == "local_sgd":
        sync: Any = LocalSGDSync(manager, module, optimizer, settings.sync_every)
    else:
        fragments = fragments or fragments_of(module, settings.fragments)
        sync = DiLoCoSync(manager, fragments, optimizer, [settings.outer(list(f.parameters())) for f in fragments],
                          settings.sync_every, should_quantize=settings.should_quantize,
                          fragment_sync_delay=settings.fragment_sync_delay,
                          fragment_update_alpha=settings.fragment_update_alpha)
    return sync.__enter__()


def _key(fragment: int) -> str:
    return f"StreamingDiLoCoFragment_{fragment}"  # torchft's key of a fragment's state


def _check_scheme(state: Dict[str, Any], scheme: str) -> None:
    if state.get("scheme") != scheme:
        raise ValueError(f"the checkpoint's low-communication state is {state.get('scheme')!r}'s; this run uses "
                         f"strategy={scheme!r}. Resume with the checkpoint's strategy.")
