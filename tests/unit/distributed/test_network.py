"""Interface choice for gloo across hosts (the multi-node suite runs it across namespaces)."""
import ipaddress
import socket
import subprocess

import pytest

from fabriclite.distributed import network


def test_loopback_interface_is_found_by_address():
    assert network.interface_address("lo") == "127.0.0.1"
    assert network.interface_with_address("127.0.0.1") == "lo"
    assert network.local_address_towards("127.0.0.1") == "127.0.0.1"


def test_no_override_for_a_loopback_main_address():
    assert network.gloo_interface("127.0.0.1") is None
    assert network.gloo_interface("localhost") is None


def _real_interfaces():
    """(name, IPv4 address) of this host's interfaces other than loopback, as `ip` lists them."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    pairs = [(line.split()[1], line.split()[3].split("/")[0]) for line in out.splitlines()]
    return [(name, addr) for name, addr in pairs if not ipaddress.ip_address(addr).is_loopback]


def test_override_here_follows_what_the_hostname_resolves_to():
    """Both cases assert. Where the hostname resolves to loopback (this machine, Debian), gloo must be pointed at the
    interface that reaches a real main address; elsewhere, nothing is overridden. The second case also runs, whatever
    this host is, in a network namespace whose hostname resolves to a real address (tests/integration/netns/test_network_netns.py)."""
    own = socket.gethostbyname(socket.gethostname())
    real = _real_interfaces()
    if not real:
        pytest.skip("this host has no interface but loopback: no main address a multi-node job could use")
    name, main = real[0]
    expected = name if ipaddress.ip_address(own).is_loopback else None
    assert network.gloo_interface(main) == expected, (own, name, main)


def test_unknown_names_do_not_raise():
    assert network.gloo_interface("no-such-host.invalid") is None
    assert network.interface_address("no-such-if0") is None
