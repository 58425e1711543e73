"""`multigpu lighthouse`: torchft's lighthouse, where the replica groups of a fault-tolerant run meet to agree on
each step's quorum; and what a launch checks of one (the HOST:PORT it is given, torchft being installed).

torchft is imported only here, inside the functions that need it: a run without replica groups never loads it."""

from __future__ import annotations

import importlib.util
import re
import signal
import sys
from dataclasses import dataclass
from typing import Protocol

from multigpu.config.settings import Settings, setting
from multigpu.core.errors import UsageError, require
from multigpu.launch.stop import Stopped

DEFAULT_PORT = 29510  # torchft_lighthouse's own default
INSTALL = "pip install 'multigpu[ft]'"
# HOST:PORT, the host a name, an IPv4 address or a bracketed IPv6 one ([::1]:29510).
ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


@dataclass
class LighthouseConfig(Settings):
    port: int = setting(DEFAULT_PORT, "the port it listens on")
    bind_address: str = setting("::", "the address it listens on (:: every interface, 127.0.0.1 this machine only)")
    # Not LaunchConfig's min_replicas: that one is checked against a launch's --replica-groups, which this has not.
    min_replicas: int = setting(1, "the fewest replica groups that may commit a step; fewer wait for more to join")
    join_timeout_ms: int = setting(
        60000,
        "how long a quorum missing one of the last quorum's groups waits for the live groups that have not asked to "
        "join it yet (torchft's default); keep it above a step's time: shorter, a group that rejoined keeps one "
        "group out of every later quorum, which then heals each step instead of training",
    )
    heartbeat_timeout_ms: int = setting(
        5000, "how long without a replica group's heartbeat before it counts as gone (torchft's default)"
    )

    def check(self) -> None:
        require(
            (0 < self.port < 65536, f"--port must be in 1..65535 (got {self.port})."),
            (bool(self.bind_address.strip()), "--bind-address must name an address, such as :: or 127.0.0.1."),
            (self.min_replicas >= 1, f"--min-replicas must be 1 or more (got {self.min_replicas})."),
            (self.join_timeout_ms >= 0, f"--join-timeout-ms must be 0 or more (got {self.join_timeout_ms})."),
            (
                self.heartbeat_timeout_ms >= 1,
                f"--heartbeat-timeout-ms must be 1 or more (got {self.heartbeat_timeout_ms}).",
            ),
        )


class ReplicaSettings(Protocol):
    """The settings of a launch (LaunchConfig) that place it among replica groups."""

    replica_groups: int
    replica_id: int | None
    lighthouse: str | None
    min_replicas: int
    nnodes: int
    master_port: int | None


def check_replica_settings(config: ReplicaSettings) -> None:
    """Refuses, in one sentence each, replica-group settings that no launch can run."""
    groups = config.replica_groups
    require(
        (groups >= 1, f"--replica-groups must be 1 or more (got {groups})."),
        (
            1 <= config.min_replicas <= groups,
            f"--min-replicas must be in 1..{groups} for --replica-groups {groups} (got {config.min_replicas}).",
        ),
        (
            config.replica_id is None or 0 <= config.replica_id < groups,
            f"--replica-id must be in 0..{groups - 1} for --replica-groups {groups} (got {config.replica_id}).",
        ),
        (
            config.replica_id is None or config.lighthouse is not None,
            "--replica-id joins the replica groups at a lighthouse; pass --lighthouse HOST:PORT of the one "
            "`multigpu lighthouse` started.",
        ),
        (
            config.lighthouse is None or config.replica_id is not None,
            "--lighthouse is where the groups of a cluster meet; pass this launch's --replica-id too, or drop "
            "both to start every group on this machine.",
        ),
        (
            groups == 1 or config.nnodes == 1,
            "A replica group runs on one node here; start one `multigpu run --replica-id I` per node, without "
            "--nnodes.",
        ),
        (
            groups == 1 or config.replica_id is not None or config.master_port is None,
            "--replica-groups on one machine starts each group on a free port of its own; drop --master-port.",
        ),
    )
    if config.lighthouse is not None:
        check_address(config.lighthouse)


def require_torchft(what: str) -> None:
    """Refuses `what` (a sentence's subject: "--replica-groups") where torchft is not installed."""
    if importlib.util.find_spec("torchft") is None:
        raise UsageError(f"{what} needs torchft, which is not installed; {INSTALL}.")


def check_address(address: str, flag: str = "--lighthouse") -> tuple[str, int]:
    """The host and port of a lighthouse's HOST:PORT, refused in one sentence where it is not one."""
    found = ADDRESS.match(address.strip())
    if found is None or not 0 < int(found["port"]) < 65536:
        raise UsageError(
            f"{flag} {address!r} must be HOST:PORT of a lighthouse that `multigpu lighthouse` started, such as "
            f"node0:{DEFAULT_PORT} or [fd00::1]:{DEFAULT_PORT}."
        )
    return found["host"], int(found["port"])


def url(address: str) -> str:
    """`http://HOST:PORT`, as torchft's Manager takes a lighthouse (TORCHFT_LIGHTHOUSE)."""
    host, port = check_address(address)
    return f"http://{host}:{port}"


def bind_string(address: str, port: int) -> str:
    """torchft's bind string: an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def serve(config: LighthouseConfig) -> int:
    """Serves a lighthouse until SIGINT or SIGTERM (the CLI's handlers raise Stopped); returns 130 or 143."""
    require_torchft("multigpu lighthouse")
    from torchft._torchft import LighthouseServer

    try:
        server = LighthouseServer(
            bind=bind_string(config.bind_address, config.port),
            min_replicas=config.min_replicas,
            join_timeout_ms=config.join_timeout_ms,
            quorum_tick_ms=100,  # torchft's default: how often a waiting quorum is looked at again
            heartbeat_timeout_ms=config.heartbeat_timeout_ms,
        )
    except RuntimeError as error:  # the port taken, or an address this machine has not
        raise UsageError(
            f"The lighthouse cannot listen on {bind_string(config.bind_address, config.port)} ({error}); pass "
            "another --port or --bind-address."
        ) from None
    # torchft names this host where it listens on every interface; an address of one interface is the one to use.
    wildcard = config.bind_address.strip() in ("::", "0.0.0.0")
    where = server.address() if wildcard else f"http://{bind_string(config.bind_address, config.port)}"
    print(
        f"multigpu lighthouse: listening on {where} for replica groups (min {config.min_replicas}); stop it with "
        "Ctrl-C.",
        flush=True,
    )
    try:
        while True:
            signal.pause()
    except Stopped as stopped:
        server.shutdown()
        print(f"multigpu lighthouse: stopped by {signal.Signals(stopped.signum).name}.", file=sys.stderr)
        return 128 + stopped.signum
