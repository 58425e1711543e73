"""Which network interface this machine talks to another one on, found from the routing table, not from its name.

gloo binds the address this machine's hostname resolves to unless GLOO_SOCKET_IFNAME names an interface, and on a
stock Debian or Ubuntu machine /etc/hosts maps the hostname to 127.0.1.1: the other nodes then try to reach a
loopback address and are refused. NCCL picks an interface by its own rules, which may be a docker bridge or a
management network. The interface the kernel would send a packet to node 0 through is the one both should use, and
a UDP socket "connected" to that address (no packet leaves) tells which local address the route picks.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from multigpu.core.errors import UsageError

INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(frozen=True)
class Route:
    """How this machine reaches `peer`: from `address`, on the interface `interface`."""

    peer: str  # the peer's address, resolved
    address: str  # this machine's address on the way there
    interface: str  # e.g. eth0, ib0, bond0; "" where no interface of this machine holds `address`

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def resolve(host: str, flag: str = "--master-addr") -> str:
    """`host` as an IP address (a name is looked up as the workers will look it up)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as error:
        raise UsageError(
            f"{flag} {host} cannot be resolved on this machine ({error}); pass node 0's IP address instead."
        ) from None


def route_to(host: str, flag: str = "--master-addr") -> Route:
    """The address and interface this machine sends packets to `host` from."""
    peer = resolve(host, flag)
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))  # a datagram socket's connect sends nothing: it only asks the routing table
        except OSError as error:
            raise UsageError(
                f"This machine has no route to {flag} {host} ({peer}: {error.strerror}); check the address, or this "
                "machine's network configuration (`ip route get ADDRESS` shows the route)."
            ) from None
        local = probe.getsockname()[0]
    return Route(peer, local, interface_holding(local))


def interface_holding(address: str) -> str:
    """The name of the interface that holds `address`, or "" where none does."""
    if ipaddress.ip_address(address).is_loopback:
        return _loopback_name()
    if ":" in address:
        return _ipv6_interface(address)
    for _, name in socket.if_nameindex():
        if ipv4_address(name) == address:
            return name
    return ""


def ipv4_address(interface: str) -> str | None:
    """The IPv4 address of `interface`, or None where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def _ipv6_interface(address: str) -> str:
    packed = ipaddress.ip_address(address).packed.hex()
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as table:
        for line in table:
            fields = line.split()
            if fields and fields[0] == packed:
                return fields[-1]
    return ""


def _loopback_name() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return "lo" if "lo" in names or not names else names[0]


def hostname_loopback() -> tuple[str, str] | None:
    """(this machine's hostname, the loopback address it resolves to), where it resolves to one; else None."""
    name = socket.gethostname()
    with contextlib.suppress(OSError, UnicodeError):
        address = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
        if ipaddress.ip_address(address).is_loopback:
            return name, address
    return None


def nameless(address: str) -> bool:
    """Whether a reverse look-up of `address` fails for want of a name server (torch's c10d then warns, on every
    connection, that "the hostname of the client socket cannot be retrieved"): harmless, the address is used as is."""
    try:
        socket.getnameinfo((address, 0), 0)
    except socket.gaierror:
        return True
    except OSError:
        return False
    return False


def interface_environment(route: Route, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to the route's interface, for those the user has not set."""
    environ = os.environ if environ is None else environ
    if not route.interface:
        return {}
    return {name: route.interface for name in INTERFACE_VARIABLES if not environ.get(name)}
