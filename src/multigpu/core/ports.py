"""Ports for servers that bind them later: chosen where no other process's connection takes them first.

Standard library only: Ray's actors import it (launch/ray_host.py) without torch."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Where free_port looks: from here up to the kernel's ephemeral ports. Above Ray's own defaults (10001 for clients,
# 10002-19999 for its workers, which bind them as they start): a suite run's Ray head refused a port chosen there.
LOWEST_CHOSEN_PORT = 20000


def free_port() -> int:
    """A TCP port nothing is bound to now, for a server that binds it later (a store, a rendezvous).

    Chosen at random below the kernel's ephemeral range (net.ipv4.ip_local_port_range), where only a bind takes a
    port: a port from that range can become the source port of another process's connection before its server
    binds it, and a worker's store binds its port only after the worker's imports, seconds later (a suite run
    failed that way with EADDRINUSE). The kernel's own choice where that range leaves no room below it."""
    lowest_ephemeral = lowest_ephemeral_port()
    chooser = random.SystemRandom()  # not the seeded generator: two processes seeded alike would pick alike
    for _ in range(64 if lowest_ephemeral > LOWEST_CHOSEN_PORT else 0):
        port = chooser.randrange(LOWEST_CHOSEN_PORT, lowest_ephemeral)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))  # every address: a store listens on all of them
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def lowest_ephemeral_port(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port the kernel gives outgoing connections (Linux's default where it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
