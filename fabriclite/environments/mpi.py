"""MPIEnvironment: ranks started by ``mpirun`` / ``mpiexec`` (Open MPI, MPICH / Intel MPI, MVAPICH2), without mpi4py."""

import os
import zlib
from typing import NamedTuple, Optional, Tuple

from fabriclite.environments._vars import first_set, main_address_or, main_port_or, read_int
from fabriclite.environments.base import ClusterEnvironment


class _Flavor(NamedTuple):
    family: str
    size: str
    rank: str
    local_rank: Tuple[str, ...]
    local_size: Tuple[str, ...]


#: Checked in this order; the first whose size and rank variables are both set is used.
FLAVORS = (
    _Flavor("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
            ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    _Flavor("MVAPICH2", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK",
            ("MV2_COMM_WORLD_LOCAL_RANK",), ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    _Flavor("MPICH / Intel MPI / PMI", "PMI_SIZE", "PMI_RANK",
            ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
)

#: Job identifiers every rank of one mpirun sees identically, used to derive a port when MASTER_PORT is unset.
JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE")
#: Port used when MASTER_PORT is unset and no job identifier is visible (torch's default).
DEFAULT_PORT = 29500


def _flavor() -> Optional[_Flavor]:
    for flavor in FLAVORS:
        if os.environ.get(flavor.size, "").strip() and os.environ.get(flavor.rank, "").strip():
            return flavor
    return None


def _job_port() -> int:
    """The port derived from the first job identifier set (JOB_ID_VARS), else DEFAULT_PORT."""
    var = first_set(JOB_ID_VARS)
    return DEFAULT_PORT if var is None else derived_port(os.environ[var].strip())


def derived_port(job_id: str) -> int:
    """A port in [20000, 30000) from a job identifier: the same on every rank, different for most jobs."""
    return 20000 + zlib.crc32(job_id.encode()) % 10000


class MPIEnvironment(ClusterEnvironment):
    """Ranks started by an MPI launcher; reads only environment variables (mpi4py is never imported).

    Detected from ``OMPI_COMM_WORLD_SIZE``/``_RANK`` (Open MPI, also jsrun/Spectrum MPI), ``MV2_COMM_WORLD_SIZE``/
    ``_RANK`` (MVAPICH2) or ``PMI_SIZE``/``PMI_RANK`` (MPICH, Intel MPI, other PMI launchers), first match wins.
    Local rank / local size: ``OMPI_COMM_WORLD_LOCAL_RANK``/``_LOCAL_SIZE``, ``MV2_COMM_WORLD_LOCAL_RANK``/
    ``_LOCAL_SIZE``, ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS`` or ``PMI_LOCAL_RANK``/``PMI_LOCAL_SIZE``.
    Node rank: ``NODE_RANK`` if set, else ``rank // local_size`` (ranks placed in blocks per node, mpirun's default
    ``--map-by slot``); a placement where that is wrong raises an error. (``OMPI_COMM_WORLD_NODE_RANK`` is *not* a
    node index in Open MPI, so it is not read.)
    Main address: ``MASTER_ADDR``; else ``127.0.0.1`` when every rank is on this node; else an error, since ranks
    on several nodes cannot agree on an address without talking. Main port: ``MASTER_PORT``; else derived from the
    first job identifier set among ``OMPI_MCA_ess_base_jobid``, ``OMPI_MCA_orte_hnp_uri``, ``PMIX_NAMESPACE``
    (``20000 + crc32(value) % 10000``); else 29500.
    """

    name = "mpi"

    @classmethod
    def detect(cls) -> bool:
        return _flavor() is not None

    def _require_flavor(self) -> _Flavor:
        flavor = _flavor()
        if flavor is None:
            pairs = ", ".join(f"{f.size}/{f.rank}" for f in FLAVORS)
            raise ValueError(f"The mpi cluster environment found none of {pairs}: start the script with mpirun.")
        return flavor

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return main_address_or(self._single_node_address)

    def _single_node_address(self) -> str:
        world = self.world_size()
        per_node = self.local_world_size()
        if per_node == world:
            return "127.0.0.1"
        where = (
            f"this node has {per_node} of the {world} ranks"
            if per_node is not None
            else f"the launcher does not say how many of the {world} ranks are on this node"
        )
        raise ValueError(
            f"The mpi cluster environment needs MASTER_ADDR when ranks span several nodes ({where}). Set it to the "
            f"host name of rank 0's node and pass it to every rank, e.g. "
            f"`mpirun -x MASTER_ADDR=<rank-0 host> -x MASTER_PORT=29500 ...` (Open MPI) or "
            f"`mpiexec -genv MASTER_ADDR <rank-0 host> -genv MASTER_PORT 29500 ...` (MPICH / Intel MPI)."
        )

    @property
    def main_port(self) -> int:
        return main_port_or(self.name, _job_port)

    def world_size(self) -> int:
        return read_int(self._require_flavor().size, self.name, minimum=1)

    def global_rank(self) -> int:
        return read_int(self._require_flavor().rank, self.name)

    def local_rank(self) -> int:
        flavor = self._require_flavor()
        var = first_set(flavor.local_rank)
        if var is None:
            if self.world_size() == 1:
                return 0
            raise ValueError(
                f"The mpi cluster environment ({flavor.family}) found no local rank: none of "
                f"{', '.join(flavor.local_rank)} is set. Use a launcher that sets it, or force another environment."
            )
        return read_int(var, self.name)

    def local_world_size(self) -> Optional[int]:
        var = first_set(self._require_flavor().local_size)
        return None if var is None else read_int(var, self.name, minimum=1)

    def node_rank(self) -> int:
        if os.environ.get("NODE_RANK", "").strip():
            return read_int("NODE_RANK", self.name)
        rank, local_rank, per_node = self.global_rank(), self.local_rank(), self.local_world_size()
        if per_node is None:
            if self.world_size() == 1:
                return 0
            raise ValueError(
                f"The mpi cluster environment ({self._require_flavor().family}) cannot derive the node rank: the "
                f"launcher does not set the number of ranks per node. Set NODE_RANK for every rank."
            )
        if rank % per_node != local_rank:
            raise ValueError(
                f"The mpi cluster environment cannot derive the node rank: rank {rank} has local rank {local_rank} "
                f"with {per_node} ranks per node, so ranks are not placed in blocks per node. Launch with "
                f"`mpirun --map-by slot` (or ppr:{per_node}:node), or set NODE_RANK for every rank."
            )
        return rank // per_node
