"""XLAEnvironment: ranks of a TPU job, as reported by the torch_xla runtime (imported only when asked)."""

import os
from types import ModuleType
from typing import Optional

from fabriclite.environments._vars import main_address_or, main_port_or
from fabriclite.environments.base import ClusterEnvironment

#: torch_xla's own default rendezvous port (``xla://`` init method) when MASTER_PORT is unset.
XLA_DEFAULT_PORT = 12355


def _runtime() -> ModuleType:
    """``torch_xla.runtime``; ModuleNotFoundError saying how to install torch_xla when it is missing."""
    try:
        from torch_xla import runtime
    except ImportError as err:
        raise ModuleNotFoundError(
            f"XLAEnvironment needs torch_xla ({err}). Install it with `pip install torch_xla` "
            f"(matching your torch version), or choose another accelerator."
        ) from None
    return runtime



def _worker_zero_address() -> str:
    """TPU worker 0's address (from torch_xla) on a TPU pod, else 127.0.0.1."""
    if os.environ.get("PJRT_DEVICE", "").strip().upper() == "TPU":
        _runtime()
        from torch_xla._internal import tpu

        return tpu.discover_master_worker_ip()
    return "127.0.0.1"

class XLAEnvironment(ClusterEnvironment):
    """A TPU job: world, ranks and host index come from ``torch_xla.runtime`` at call time.

    Not part of automatic detection (the XLA strategy picks it, as in Lightning); can be forced by name "xla".
    :meth:`detect` only reads ``os.environ``: ``PJRT_DEVICE=TPU`` or the legacy ``XRT_TPU_CONFIG`` — it says a TPU
    runtime was asked for, not that one exists. fabriclite's XLA launcher starts the processes, so
    ``creates_processes_externally`` is False. Main address / port are what torch_xla's ``xla://`` rendezvous
    uses: ``MASTER_ADDR`` (else the TPU worker 0 address from torch_xla, or 127.0.0.1 off TPU) and ``MASTER_PORT``
    (else 12355).
    """

    name = "xla"

    @classmethod
    def detect(cls) -> bool:
        pjrt = os.environ.get("PJRT_DEVICE", "").strip().upper()
        return pjrt == "TPU" or bool(os.environ.get("XRT_TPU_CONFIG", "").strip())

    @property
    def creates_processes_externally(self) -> bool:
        return False

    @property
    def main_address(self) -> str:
        return main_address_or(_worker_zero_address)

    @property
    def main_port(self) -> int:
        return main_port_or(self.name, lambda: XLA_DEFAULT_PORT)

    def world_size(self) -> int:
        return int(_runtime().world_size())

    def global_rank(self) -> int:
        return int(_runtime().global_ordinal())

    def local_rank(self) -> int:
        return int(_runtime().local_ordinal())

    def node_rank(self) -> int:
        return int(_runtime().host_index())

    def local_world_size(self) -> Optional[int]:
        return int(_runtime().local_process_count())

    def num_nodes(self) -> Optional[int]:
        """``world_size / local_world_size`` when that divides evenly, else None."""
        world, per_node = self.world_size(), self.local_world_size()
        if not per_node or world % per_node:
            return None
        return world // per_node
