"""Object collectives over tensor primitives: every rank's object, or one rank's, as bytes in tensors, loaded
with the restricted unpickler (``object_pickle``), never with ``torch.distributed``'s ``all_gather_object`` /
``broadcast_object_list`` (which unpickle whatever a peer sent, tensors included through
``torch.load(weights_only=False)``).

The strategies' ``all_gather_object`` / ``broadcast_object`` and the background checkpoint writer build on these,
each handing in its own gather / broadcast of one tensor. Two collectives per call (the lengths, then the bytes),
as torch's own.

May import: ``object_pickle`` and torch.
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch import Tensor

from fabriclite.collectives.object_pickle import dumps, loads

#: gather: this rank's 1-D tensor -> every rank's, stacked ``(group size, n)``
Gather = Callable[[Tensor], Tensor]
#: broadcast: the root's tensor into this rank's tensor of the same shape and dtype, returned
Broadcast = Callable[[Tensor], Tensor]


def _as_tensor(payload: bytes, length: int, device: torch.device) -> Tensor:
    """``payload`` as a uint8 tensor of ``length`` bytes (zero-padded) on ``device``."""
    out = torch.zeros(length, dtype=torch.uint8)
    if payload:
        out[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out.to(device)


def all_gather_objects(obj: Any, gather: Gather, device: torch.device) -> List[Any]:
    """Every rank's ``obj`` in group-rank order (this rank's own loaded back too, so every rank gets the same
    values); tensors inside come back on the CPU. UnpicklingError naming a class no rank may send (see
    ``object_pickle``)."""
    payload = dumps(obj)
    sizes = gather(torch.tensor([len(payload)], dtype=torch.int64, device=device)).reshape(-1).tolist()
    rows = gather(_as_tensor(payload, max(sizes), device)).cpu()
    return [loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]


def broadcast_object(obj: Any, is_src: bool, broadcast: Broadcast, device: torch.device) -> Any:
    """The root's ``obj`` on every rank (the root gets its own object back, unpickled nowhere); tensors inside
    arrive on the CPU. UnpicklingError on a receiving rank naming a class it does not allow."""
    payload = dumps(obj) if is_src else b""
    size = int(broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=device)).reshape(-1)[0])
    data = broadcast(_as_tensor(payload, size, device) if is_src
                     else torch.empty(size, dtype=torch.uint8, device=device))
    if is_src:
        return obj
    return loads(data.cpu().numpy().tobytes())


__all__ = ["all_gather_objects", "broadcast_object"]
