"""A fake cluster on one Linux host: one network namespace per node, so each node has its own address,
hostname and ports, and ranks talk over a real (virtual) network instead of 127.0.0.1.

Topology (nothing is added to the root namespace, nothing is routable to the outside)::

    netns <prefix>hub : bridge br0 (no address) + one veth end per node, named <prefix>nK
    netns <prefix>nK  : lo + eth0 (the veth peer) with 10.250.0.(10+K)/24, no default route
    /etc/netns/<prefix>nK/{hosts,resolv.conf}: `ip netns exec` bind-mounts them over /etc, so inside node K
        the names <prefix>n0..nN-1 resolve to the node addresses and DNS goes nowhere.

:meth:`Cluster.exec` also gives the command its own UTS namespace with hostname <prefix>nK, so
``gethostname()`` resolves to the node's own address, as on a real machine; gloo then picks that
interface without GLOO_SOCKET_IFNAME.

Never send traffic to a node address from the root namespace: there it would follow the default route.

Needs root and iproute2 (``ip``) and util-linux (``unshare``). Adapted from netns_cluster.sh; manual use::

    python tests/integration/netns/cluster.py up 3 [PREFIX] | down PREFIX | sweep
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

#: names of what a test run's cluster makes: "fl<pid of the run>" + "n<node>" or "hub"
RUN_NAME_RE = re.compile(r"^fl(\d{1,7})(?:n\d+|hub)$")
ETC = Path("/etc/netns")
ETC_MARK = ".fabriclite-created"   # in /etc/netns: we created the directory, remove it when it is empty
HOSTS_TAG = "# fabriclite netns cluster"


def lifetime(num_nodes: int) -> Iterator["Cluster"]:
    """For a fixture: sweep dead runs' leftovers, bring ``num_nodes`` nodes up, yield the cluster, take it down
    (also at exit, for an interrupted run) and check nothing is left. Check ``unavailable_reason()`` first."""
    sweep()
    nodes = Cluster(num_nodes)
    atexit.register(nodes.down)
    try:
        yield nodes.up()
    finally:
        nodes.down()
        atexit.unregister(nodes.down)
    assert not nodes.leftovers(), f"left after teardown: {nodes.leftovers()}"


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install {package}"
    probe = f"flprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return f"cannot create a network namespace (no CAP_SYS_ADMIN?): {made.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _namespaces() -> List[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class Cluster:
    """``num_nodes`` hosts; node K is namespace ``<prefix>nK`` at ``addr(K)`` with hostname ``host(K)``."""

    def __init__(self, num_nodes: int, prefix: Optional[str] = None, subnet: str = "10.250.0") -> None:
        self.prefix = prefix or f"fl{os.getpid()}"
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,8}", self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: 1-9 characters (interface names are at most 15)")
        self.num_nodes = num_nodes
        self.subnet = subnet
        self.hub = f"{self.prefix}hub"

    def host(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def addr(self, node: int) -> str:
        return f"{self.subnet}.{10 + node}"

    # ------------------------------------------------------------------ up / exec / down
    def up(self) -> "Cluster":
        """Create the hub, the nodes and their /etc/netns files; on any error remove what was made."""
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for k in range(self.num_nodes):
                ns = self.host(k)
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                # made directly inside both namespaces: nothing ever appears in the root namespace
                _ip("link", "add", ns, "netns", self.hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.hub, "link", "set", ns, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                self._write_etc(ns)
        except BaseException:
            self.down()
            raise
        return self

    def exec(self, node: int, cmd: Sequence[str], env: Optional[Dict[str, str]] = None,
             **popen_kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside node ``node`` (its network, its /etc/hosts, hostname ``host(node)``) with
        ``env`` (the whole environment; default: this process's). The Popen's pid is the command's own
        (ip netns exec, unshare and sh all exec in place)."""
        ns = self.host(node)
        wrapper = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', ns]
        return subprocess.Popen([*wrapper, *cmd], env=env, **popen_kwargs)

    def pids(self, node: Optional[int] = None) -> List[int]:
        """Processes living in node ``node`` (default: in any node or the hub)."""
        names = [self.host(node)] if node is not None else self._our_namespaces()
        return [int(p) for ns in names for p in _ip("netns", "pids", ns, check=False).stdout.split()]

    def listeners(self, node: int) -> List[str]:
        """The local addresses (``ADDR:PORT`` as ``ss`` writes them) of every listening TCP socket in node
        ``node``."""
        out = subprocess.run(["ip", "netns", "exec", self.host(node), "ss", "-Hltn"], capture_output=True,
                             text=True, check=True).stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]

    def wildcard_listeners(self, node: int) -> List[str]:
        """Node ``node``'s listening TCP sockets that are on every interface (``*``, ``0.0.0.0``, ``[::]``), each
        as ``ss -ltnp`` writes it (with its process)."""
        out = subprocess.run(["ip", "netns", "exec", self.host(node), "ss", "-Hltnp"], capture_output=True,
                             text=True, check=True).stdout
        return [line for line in out.splitlines()
                if line.strip() and line.split()[3].rsplit(":", 1)[0] in ("*", "0.0.0.0", "[::]")]

    def kill_all(self, grace_s: float = 2.0) -> None:
        """SIGTERM every process in the cluster, SIGKILL what is left after ``grace_s``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.05)

    def down(self) -> None:
        """Remove every process, namespace, link and /etc/netns entry of this prefix (safe to repeat)."""
        self.kill_all()
        for ns in self._our_namespaces():
            _ip("netns", "del", ns, check=False)  # deleting a namespace deletes its veth ends and bridge
        for ns in [self.hub, *(self.host(k) for k in range(self.num_nodes))]:
            _remove_etc(ns)
        if ETC.is_dir():
            for entry in ETC.iterdir():
                if self._owns(entry.name):
                    _remove_etc(entry.name)

    def leftovers(self) -> List[str]:
        """What of this cluster still exists (empty after :meth:`down`)."""
        found = [f"netns {ns}" for ns in self._our_namespaces()]
        found += [f"{ETC / e.name}" for e in (ETC.iterdir() if ETC.is_dir() else []) if self._owns(e.name)]
        found += [f"link {name}" for name in _root_links() if self._owns(name)]
        return found

    # ------------------------------------------------------------------ helpers
    def _owns(self, name: str) -> bool:
        return re.fullmatch(rf"{re.escape(self.prefix)}(n\d+|hub)", name) is not None

    def _our_namespaces(self) -> List[str]:
        return [ns for ns in _namespaces() if self._owns(ns)]

    def _write_etc(self, ns: str) -> None:
        if not ETC.is_dir():
            ETC.mkdir(parents=True, exist_ok=True)
            (ETC / ETC_MARK).touch()
        d = ETC / ns
        d.mkdir(parents=True, exist_ok=True)  # /etc/netns again if another run's cluster removed it meanwhile
        nodes = "".join(f"{self.addr(k)} {self.host(k)}\n" for k in range(self.num_nodes))
        (d / "hosts").write_text(f"{HOSTS_TAG}\n127.0.0.1 localhost\n::1 localhost ip6-localhost\n{nodes}")
        (d / "resolv.conf").write_text("")  # no nameserver: lookups of unknown names fail fast


def _remove_etc(ns: str) -> None:
    """Remove /etc/netns/<ns> if we wrote it, and /etc/netns itself if we created it and it is empty."""
    d = ETC / ns
    hosts = d / "hosts"
    if hosts.is_file() and hosts.read_text().startswith(HOSTS_TAG):
        for name in ("hosts", "resolv.conf"):
            (d / name).unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:
            pass
    if (ETC / ETC_MARK).exists() and [e.name for e in ETC.iterdir()] == [ETC_MARK]:
        (ETC / ETC_MARK).unlink(missing_ok=True)
        try:
            ETC.rmdir()
        except OSError:
            pass


def _root_links() -> List[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def sweep() -> List[str]:
    """Tear down clusters left by test runs that died without cleaning up (their pid no longer runs)."""
    names = _namespaces() + ([e.name for e in ETC.iterdir()] if ETC.is_dir() else [])
    owners = {int(m.group(1)) for m in map(RUN_NAME_RE.match, names) if m}
    dead = sorted(pid for pid in owners if not Path(f"/proc/{pid}").exists())
    for pid in dead:
        Cluster(0, f"fl{pid}").down()
    return [f"fl{pid}" for pid in dead]


if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["up"]:
        cluster = Cluster(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None).up()
        print(" ".join(f"{cluster.host(k)}={cluster.addr(k)}" for k in range(cluster.num_nodes)))
    elif command == ["down"]:
        Cluster(0, sys.argv[2]).down()
    elif command == ["sweep"]:
        print("swept:", sweep())
    else:
        raise SystemExit(__doc__)
