"""free_port: a port for a server that binds it later, from where no other process's connection takes it."""

from __future__ import annotations

import random
import socket
from pathlib import Path
from unittest import mock

from multigpu.core import ports
from multigpu.core.ports import LOWEST_CHOSEN_PORT, free_port, lowest_ephemeral_port


def test_the_port_is_below_the_kernels_ephemeral_range_and_free_on_every_address() -> None:
    port = free_port()
    assert LOWEST_CHOSEN_PORT <= port < lowest_ephemeral_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", port))


def test_a_port_something_is_bound_to_is_passed_over() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))  # one address only: the port is still taken for a store on all of them
        busy = taken.getsockname()[1]
        with (
            mock.patch.object(ports, "lowest_ephemeral_port", return_value=busy + 2),
            mock.patch.object(random.SystemRandom, "randrange", side_effect=[busy, busy + 1]),
        ):
            assert free_port() == busy + 1


def test_a_range_with_no_room_below_it_leaves_the_choice_to_the_kernel() -> None:
    with mock.patch.object(ports, "lowest_ephemeral_port", return_value=LOWEST_CHOSEN_PORT):
        assert free_port() > 0


def test_the_range_is_read_from_the_kernel_or_linuxs_default(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("40000\t50000\n")
    assert lowest_ephemeral_port(tmp_path / "range") == 40000
    assert lowest_ephemeral_port(tmp_path / "missing") == 32768
