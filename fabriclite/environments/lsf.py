"""LSFEnvironment: ranks started by IBM LSF's ``jsrun`` (Job Step Manager)."""

import os
import socket
from typing import List, Optional

from fabriclite.environments._vars import all_set, main_address_or, main_port_or, parse_int, read_int, read_str
from fabriclite.environments.base import ClusterEnvironment

#: what Lightning's LSFEnvironment.detect requires (jsrun sets the JSM_* ones, LSF the others)
_REQUIRED = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE")


class LSFEnvironment(ClusterEnvironment):
    """Ranks started by ``jsrun`` in an LSF job.

    Detected when ``LSB_JOBID``, ``LSB_DJOB_RANKFILE``, ``JSM_NAMESPACE_LOCAL_RANK`` and ``JSM_NAMESPACE_SIZE`` are
    set (Lightning's rule). World, rank and local rank come from the ``JSM_NAMESPACE_*`` variables. The job's hosts
    are read from the rank file named by ``LSB_DJOB_RANKFILE`` (one host per line); as in Lightning, the first entry
    is the launch node and is dropped (kept when it is the only one). Main address: ``MASTER_ADDR``, else the first
    remaining host. Node rank: position of this machine's host name (or its short name) among the distinct hosts.
    Main port: ``MASTER_PORT``, else ``10000 + LSB_JOBID % 1000`` (as Lightning).
    """

    name = "lsf"

    @classmethod
    def detect(cls) -> bool:
        return all_set(_REQUIRED)

    @property
    def creates_processes_externally(self) -> bool:
        return True

    def hosts(self) -> List[str]:
        """The job's compute hosts, one entry per slot, launch node removed."""
        rankfile = read_str("LSB_DJOB_RANKFILE", self.name)
        try:
            with open(rankfile, encoding="utf-8") as handle:
                entries = [line.strip() for line in handle if line.strip()]
        except OSError as err:
            raise ValueError(f"The lsf cluster environment cannot read LSB_DJOB_RANKFILE={rankfile!r}: {err}") from None
        if not entries:
            raise ValueError(f"The lsf cluster environment found no host in LSB_DJOB_RANKFILE={rankfile!r}.")
        return entries[1:] if len(entries) > 1 else entries

    @property
    def main_address(self) -> str:
        return main_address_or(lambda: self.hosts()[0])

    @property
    def main_port(self) -> int:
        return main_port_or(
            self.name, lambda: 10000 + parse_int("LSB_JOBID", read_str("LSB_JOBID", self.name), self.name) % 1000)

    def world_size(self) -> int:
        return read_int("JSM_NAMESPACE_SIZE", self.name, minimum=1)

    def global_rank(self) -> int:
        return read_int("JSM_NAMESPACE_RANK", self.name)

    def local_rank(self) -> int:
        return read_int("JSM_NAMESPACE_LOCAL_RANK", self.name)

    def _distinct_hosts(self) -> List[str]:
        return list(dict.fromkeys(self.hosts()))

    def node_rank(self) -> int:
        distinct = self._distinct_hosts()
        hostname = socket.gethostname()
        short_names = [host.split(".")[0] for host in distinct]
        if hostname in distinct:
            return distinct.index(hostname)
        if hostname.split(".")[0] in short_names:
            return short_names.index(hostname.split(".")[0])
        raise ValueError(
            f"The lsf cluster environment cannot find this host ({hostname!r}) among the job's hosts {distinct}."
        )

    def num_nodes(self) -> Optional[int]:
        """Distinct hosts of the job, or None when LSB_DJOB_RANKFILE is not set."""
        if not os.environ.get("LSB_DJOB_RANKFILE", "").strip():
            return None
        return len(self._distinct_hosts())
