"""Interface choice for gloo across hosts (the multi-node suite runs it across namespaces)."""
import socket

from fabriclite import network


def test_loopback_interface_is_found_by_address():
    assert network.interface_address("lo") == "127.0.0.1"
    assert network.interface_with_address("127.0.0.1") == "lo"
    assert network.local_address_towards("127.0.0.1") == "127.0.0.1"


def test_no_override_for_a_loopback_main_address():
    assert network.gloo_interface("127.0.0.1") is None
    assert network.gloo_interface("localhost") is None


def test_no_override_where_the_hostname_resolves_to_a_real_address():
    own = socket.gethostbyname(socket.gethostname())
    if not own.startswith("127."):
        assert network.gloo_interface(own) is None


def test_unknown_names_do_not_raise():
    assert network.gloo_interface("no-such-host.invalid") is None
    assert network.interface_address("no-such-if0") is None
