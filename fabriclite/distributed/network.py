"""Which network interface gloo should use.

gloo listens on the address this host's name resolves to. Debian and Ubuntu map the hostname to
127.0.1.1 in /etc/hosts, so a multi-node gloo job there binds to loopback and times out at start-up.
``gloo_interface(main_address)`` names the interface that routes to the main address in exactly
that case, so the rank can set ``GLOO_SOCKET_IFNAME`` before creating its process group.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Optional

_SIOCGIFADDR = 0x8915


def gloo_interface(main_address: str) -> Optional[str]:
    """The interface that reaches ``main_address`` when this host's name resolves to a loopback address
    and ``main_address`` is not a loopback address; None otherwise (gloo's own choice is right)."""
    try:
        own = socket.gethostbyname(socket.gethostname())
        main = socket.gethostbyname(main_address)
    except OSError:
        return None
    if not ipaddress.ip_address(own).is_loopback or ipaddress.ip_address(main).is_loopback:
        return None
    local = local_address_towards(main)
    return interface_with_address(local) if local else None


def local_address_towards(address: str) -> Optional[str]:
    """This host's IPv4 address on the route to ``address`` (a UDP connect: nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))
        except OSError:
            return None
        return sock.getsockname()[0]


def interface_with_address(address: str) -> Optional[str]:
    """The name of the interface holding IPv4 ``address``, if any."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def interface_address(name: str) -> Optional[str]:
    """The IPv4 address of interface ``name`` (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])
