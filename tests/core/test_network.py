"""Which interface a node talks on: found from the routing table; what the user set is kept."""

from __future__ import annotations

import socket

import pytest

from multigpu.core.errors import UsageError
from multigpu.core.network import Route, interface_environment, resolve, route_to


def test_the_route_to_this_machine_is_loopback() -> None:
    route = route_to("127.0.0.1")
    assert route == Route("127.0.0.1", "127.0.0.1", route.interface) and route.loopback
    assert route.interface in {name for _, name in socket.if_nameindex()}


def test_the_interface_variables_are_set_only_where_the_user_left_them_unset() -> None:
    route = Route("10.0.0.1", "10.0.0.2", "ib0")
    assert interface_environment(route, {}) == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert interface_environment(route, {"NCCL_SOCKET_IFNAME": "eth1"}) == {"GLOO_SOCKET_IFNAME": "ib0"}
    assert interface_environment(Route("10.0.0.1", "10.0.0.2", ""), {}) == {}  # no interface holds it: say nothing


def test_a_master_address_that_does_not_resolve_is_one_sentence() -> None:
    with pytest.raises(UsageError, match=r"^--master-addr no-such-host\.invalid cannot be resolved on this machine"):
        resolve("no-such-host.invalid")
