"""Several "nodes" on this machine: network namespaces, each with its own address on a link to one switch.

Each node is a network namespace holding one end of a veth pair (its interface, `eth-<i>` there) with the address
10.231.0.<i+1>/24; the other ends hang on a bridge inside a namespace of its own (the switch), so the nodes reach
each other and nothing else: no route leaves the namespaces this module made. A link can be shaped (tc's token
bucket on the node's side, both directions), taken down and brought back. The nodes share this machine's
filesystem, processes and CPU cores; only the network is theirs.

Needs root and a kernel that allows namespaces; `cluster()` raises NodesRefused otherwise, and the tests skip with
its reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBNET = "10.231.0"  # the nodes' addresses, inside their namespaces only
_CLONE_NEWNET = 0x40000000


def node_address(index: int) -> str:
    return f"{SUBNET}.{index + 1}"


def enter(namespace: str) -> None:
    """Moves this process (single-threaded: a fork) into the network namespace `namespace`."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{namespace}") as handle:
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter the network namespace {namespace}")


class NodesRefused(RuntimeError):
    """This machine does not let us make network namespaces (not root, or the kernel refuses)."""


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    address: str
    interface: str  # its end of the link, inside its namespace
    switch_port: str  # the other end, on the switch's bridge

    def argv(self, command: Sequence[str]) -> list[str]:
        """`command` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]

    def multigpu(self, *args: str) -> list[str]:
        """`multigpu ARGS` as a user on this node types it (this checkout's Python)."""
        return self.argv([sys.executable, "-m", "multigpu", *args])


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    switch: str  # the switch's namespace

    @property
    def master(self) -> Node:
        return self.nodes[0]

    def link(self, node: Node, up: bool) -> None:
        """Takes `node`'s link down (as a pulled cable: its packets go nowhere, no connection is closed) or up."""
        _ip("-n", self.switch, "link", "set", node.switch_port, "up" if up else "down")

    def shape(self, rate: str | None) -> None:
        """Every node's link limited to `rate` (tc's units: 100mbit, 1gbit) each way; None lifts the limit."""
        for node in self.nodes:
            for namespace, device in ((node.namespace, node.interface), (self.switch, node.switch_port)):
                subprocess.run(
                    ["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"],
                    capture_output=True,
                )
                if rate is not None:
                    # burst: what the bucket holds; 64 KiB lets a full-size TCP segment train through at 1 Gbit/s.
                    _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
                         "rate", rate, "burst", "64kb", "latency", "100ms")  # fmt: skip


def _run(*argv: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise NodesRefused(f"{argv[0]} is not installed (iproute2)") from None
    if done.returncode != 0:
        raise NodesRefused(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")


def _ip(*args: str) -> None:
    _run("ip", *args)


@contextlib.contextmanager
def cluster(count: int, rate: str | None = None) -> Iterator[Cluster]:
    """`count` nodes joined by a switch, torn down after (names carry this process's pid: test files run side by
    side)."""
    if os.geteuid() != 0:
        raise NodesRefused("making network namespaces needs root")
    tag = f"mg{os.getpid() % 100000}"
    switch = f"{tag}sw"
    nodes = tuple(Node(i, f"{tag}n{i}", f"{SUBNET}.{i + 1}", f"eth{i}", f"{tag}p{i}"[-15:]) for i in range(count))
    made: list[str] = []
    try:
        for namespace in (switch, *(node.namespace for node in nodes)):
            _ip("netns", "add", namespace)
            made.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for node in nodes:
            _ip("-n", node.namespace, "link", "add", node.interface, "type", "veth", "peer", "name",
                node.switch_port, "netns", switch)  # fmt: skip
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            _ip("-n", switch, "link", "set", node.switch_port, "master", "br0")
            _ip("-n", switch, "link", "set", node.switch_port, "up")
        made_cluster = Cluster(nodes, switch)
        if rate is not None:
            made_cluster.shape(rate)
        yield made_cluster
    finally:
        for namespace in reversed(made):  # deleting a namespace deletes the links in it
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
