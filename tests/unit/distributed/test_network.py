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


def _listening(port: int) -> list:
    """The local addresses of the listening TCP sockets on ``port`` (from ss)."""
    import subprocess

    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def test_the_store_listens_on_its_address_alone() -> None:
    from datetime import timedelta

    from fabriclite.distributed import rendezvous

    store = rendezvous.host_store("127.0.0.1", 0, timedelta(seconds=10))
    assert _listening(store.port) == [f"127.0.0.1:{store.port}"]  # torch's own server listens on *:PORT
    client = rendezvous.join_store("127.0.0.1", store.port, timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_where_no_single_address_can_be_chosen_every_interface_listens() -> None:
    import socket

    from fabriclite.distributed import rendezvous

    for address in ("0.0.0.0", "", "192.0.2.1"):  # unspecified; not an address of this host (TEST-NET-1)
        assert rendezvous.listener(address, 0) is None, address
    sock = rendezvous.listener("localhost", 0)
    assert sock is not None and ipaddress.ip_address(sock.getsockname()[0]).is_loopback
    sock.close()
    name = socket.gethostname()
    resolved = socket.gethostbyname(name)
    if ipaddress.ip_address(resolved).is_loopback:  # Debian: the host's name maps to 127.0.1.1 here only
        assert rendezvous.listener(name, 0) is None
