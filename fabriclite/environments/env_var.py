"""EnvVarEnvironment: the plain ``env://`` contract (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) — Kubeflow & co."""

import os
from typing import Optional

from fabriclite.environments._vars import all_set, read_int, read_optional_int, read_port, read_str
from fabriclite.environments.base import ClusterEnvironment

_REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class EnvVarEnvironment(ClusterEnvironment):
    """Ranks started by anything that sets torch's ``env://`` variables (Kubeflow PyTorchJob, hand-written scripts).

    Detected when ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` are all set. ``LOCAL_RANK``
    defaults to 0 and ``LOCAL_WORLD_SIZE`` is optional. Node rank: ``NODE_RANK``, else ``GROUP_RANK``, else
    ``RANK // LOCAL_WORLD_SIZE`` when ``LOCAL_WORLD_SIZE`` is set, else ``RANK`` when ``LOCAL_RANK`` is unset too
    (one process per node/pod, Kubeflow's layout and Lightning's KubeflowEnvironment rule), else 0.
    """

    name = "env"

    @classmethod
    def detect(cls) -> bool:
        return all_set(_REQUIRED)

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return read_str("MASTER_ADDR", self.name)

    @property
    def main_port(self) -> int:
        return read_port("MASTER_PORT", self.name)

    def world_size(self) -> int:
        return read_int("WORLD_SIZE", self.name, minimum=1)

    def global_rank(self) -> int:
        return read_int("RANK", self.name)

    def local_rank(self) -> int:
        return read_int("LOCAL_RANK", self.name, default=0)

    def local_world_size(self) -> Optional[int]:
        return read_optional_int("LOCAL_WORLD_SIZE", self.name, minimum=1)

    def node_rank(self) -> int:
        for var in ("NODE_RANK", "GROUP_RANK"):
            if os.environ.get(var, "").strip():
                return read_int(var, self.name)
        per_node = self.local_world_size()
        if per_node is not None:
            return self.global_rank() // per_node
        if not os.environ.get("LOCAL_RANK", "").strip():
            return self.global_rank()
        return 0


#: Lightning's name; unlike Lightning's, this one is auto-detected (after every scheduler).
KubeflowEnvironment = EnvVarEnvironment
