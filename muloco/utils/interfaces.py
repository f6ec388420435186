"""This host's network interfaces: which one holds an address, which address a route uses.

torchft advertises ``socket.gethostname()`` to its peers (its manager and healing servers) and
gloo picks its interface from the same name. On a node whose hostname resolves to another
interface than the one the peers reach (several NICs, a network namespace) that address is
wrong, so a replica group can be told its address, and these find the interface behind it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (None: it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The interface that holds IPv4 ``address`` on this host (None: none does)."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def route_address(host: str, port: int) -> str:
    """The local address this host's routes use to reach ``host:port`` (no packet is sent: a UDP
    socket's connect only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), port))
        return s.getsockname()[0]


def is_ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False
