"""Where the scale model runs: a network namespace of its own, with only loopback up and no name server.

torch's TCPStore looks up the peer's name of every connection it makes or accepts (for its log lines); with the
machine's resolver that is a DNS query per connection, and 5 s each when the answer is slow, so thousands of
connections would take hours and send thousands of queries out. In a fresh namespace with an empty resolv.conf the
lookup fails at once, nothing leaves the machine, and the namespace's own ~28,000 ephemeral ports are the model's.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
from typing import List

INSIDE_ENV = "CONTROL_PLANE_SANDBOXED"


def unavailable_reason() -> str:
    """Why the sandbox cannot be made here ("" when it can)."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces)"
    for tool in ("unshare", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found"
    return ""


def reexec_inside(argv: List[str]) -> int:
    """Run ``python argv`` inside a new network + mount namespace (loopback up, an empty /etc/resolv.conf, the
    soft open-files limit raised to the hard one); its exit code."""
    empty = tempfile.NamedTemporaryFile(prefix="control-plane-resolv-", delete=False)
    empty.close()
    try:
        script = ('ip link set lo up && mount --bind "$0" /etc/resolv.conf && ulimit -n "$(ulimit -Hn)" && '
                  'exec "$@"')
        env = {**os.environ, INSIDE_ENV: "1"}
        return subprocess.call(["unshare", "--net", "--mount", "sh", "-c", script, empty.name,
                                sys.executable, *argv], env=env)
    finally:
        os.unlink(empty.name)


def inside() -> bool:
    return os.environ.get(INSIDE_ENV) == "1"


def open_files_limit() -> int:
    """The soft limit on open files, raised to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def ephemeral_ports() -> int:
    """How many ephemeral ports this namespace has."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return high - low + 1
    except (OSError, ValueError):
        return 28000
