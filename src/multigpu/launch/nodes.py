"""A node of a run over several machines: the interface its workers talk on, said in one line.

The launcher finds the interface that routes to node 0 (multigpu.core.network) and hands it to its workers as
GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, unless the user set them. Where this machine cannot look its own address
or node 0's up by name (no DNS server reachable: common inside clusters and containers), torch's c10d warns on
every connection that "the hostname of the client socket cannot be retrieved"; those lines are left out of what
the node prints, and its one line says why.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import select
import sys

from multigpu.core.child_processes import die_with_parent
from multigpu.core.network import Route, hostname_loopback, interface_environment, nameless, route_to

C10D_NAMELESS = b"The hostname of the client socket cannot be retrieved"


def node_line(node_rank: int, nnodes: int, master: str, route: Route, set_here: dict[str, str], quiet: bool) -> str:
    """What a node says at start: where it talks, and why there (`quiet`: c10d's nameless warnings left out)."""
    where = f"{route.interface}, {route.address}" if route.interface else route.address
    notes = [f"{' and '.join(set_here)} set to {route.interface}"] if set_here else []
    named = hostname_loopback()
    if named is not None and not route.loopback:
        notes.append(f"the hostname {named[0]} resolves to loopback {named[1]}, so it is not used")
    if quiet:
        notes.append("c10d's harmless warnings that this address has no hostname are left out")
    return f"multigpu run: node {node_rank} of {nnodes} talks to node 0 ({master}) on {where}" + (
        f" ({'; '.join(notes)})." if notes else "."
    )


def master_warning(master_addr: str, route: Route) -> str | None:
    """One line where --master-addr is a name that resolves to loopback here: only this machine can reach it."""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(master_addr)
        return None  # an address typed as such (127.0.0.1 on one machine) is meant
    if not ipaddress.ip_address(route.peer).is_loopback:
        return None
    return (
        f"multigpu run: warning: --master-addr {master_addr} resolves to {route.peer} on this machine, a loopback "
        "address that other machines cannot reach; pass node 0's network address unless every node runs here."
    )


def prepare_node(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> Route:
    """Sets this node's interface variables for its workers and prints the node's line (and any warning)."""
    route = route_to(master_addr)
    warning = master_warning(master_addr, route)
    if warning:
        print(warning, file=sys.stderr)
    set_here = interface_environment(route)
    os.environ.update(set_here)
    quiet = not route.loopback and (nameless(route.address) or nameless(route.peer))
    if quiet:
        leave_out_stderr_lines(C10D_NAMELESS)
    print(node_line(node_rank, nnodes, f"{master_addr}:{master_port}", route, set_here, quiet), file=sys.stderr)
    return route


def leave_out_stderr_lines(marker: bytes) -> None:
    """From now on, lines containing `marker` written to this process's stderr, or its children's (the workers
    inherit the descriptor), are dropped; everything else passes as written.

    A forked process reads a pipe put in place of descriptor 2 and copies it to the real stderr; it ends when the
    last writer (this process, its workers) has ended, so no line written before the end is lost. C++ writes these
    warnings straight to the descriptor, which is why no Python logging filter can reach them.
    """
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the filter: nothing but reads and writes of bytes
        os.close(write)
        die_with_parent()
        _copy_lines(read, 2, marker)
        os._exit(0)
    os.close(read)
    os.dup2(write, 2)
    os.close(write)


def _copy_lines(source: int, target: int, marker: bytes) -> None:
    pending = b""
    while True:
        # A partial line (a progress bar's \r update) waits for its end at most 0.2 s, then passes as it is.
        ready, _, _ = select.select([source], [], [], 0.2 if pending else None)
        if not ready:
            _write(target, pending)
            pending = b""
            continue
        chunk = os.read(source, 65536)
        if not chunk:
            _write(target, pending)
            return
        *lines, pending = (pending + chunk).split(b"\n")
        _write(target, b"".join(line + b"\n" for line in lines if marker not in line))


def _write(target: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(target, data) :]
        except OSError:
            return
