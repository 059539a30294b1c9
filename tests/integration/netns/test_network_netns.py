"""gloo's interface choice on a host whose name resolves to a real (non-loopback) address: a node of the
namespace cluster (hostname <prefix>nK, resolving to 10.250.0.(10+K) there). The host running the suite may
resolve its name to loopback (this machine, Debian), where tests/unit/distributed/test_network.py checks the other case."""
from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest

from cluster import Cluster

pytestmark = [pytest.mark.netns, pytest.mark.slow]

PROBE = ("import json, socket, sys\n"
         "from fabriclite.distributed import network\n"
         "own = socket.gethostbyname(socket.gethostname())\n"
         "print(json.dumps({'own': own, 'towards_main': network.gloo_interface(sys.argv[1]),\n"
         "                  'towards_loopback': network.gloo_interface('127.0.0.1')}))\n")


def test_no_override_where_the_hostname_resolves_to_a_real_address(cluster: Cluster) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = cluster.exec(1, [sys.executable, "-c", PROBE, cluster.host(0)], env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    found = json.loads(out.strip().splitlines()[-1])
    assert found["own"] == cluster.addr(1) and not ipaddress.ip_address(found["own"]).is_loopback, found
    assert found == {"own": cluster.addr(1), "towards_main": None, "towards_loopback": None}, found
