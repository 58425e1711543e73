"""What a worker of a fault-tolerant run learns from its launcher: which replica group it belongs to, how many there
are, where their lighthouse listens and how few may train on. `multigpu run --replica-groups N` sets them (and
torchft's own REPLICA_GROUP_ID); the Engine reads them (multigpu.engine.replicas)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

GROUP_ID = "REPLICA_GROUP_ID"  # torchft's examples' name for it
GROUPS = "MULTIGPU_REPLICA_GROUPS"
LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # the variable torchft's Manager reads when given no address
MIN_REPLICAS = "MULTIGPU_MIN_REPLICAS"


@dataclass(frozen=True)
class ReplicaGroup:
    """This process's replica group among `groups`, the lighthouse's `http://host:port` and the fewest groups that
    may go on training."""

    group_id: int
    groups: int
    lighthouse: str
    min_replicas: int

    def environment(self) -> dict[str, str]:
        """The variables a launcher gives each worker of this group."""
        return {
            GROUP_ID: str(self.group_id),
            GROUPS: str(self.groups),
            LIGHTHOUSE: self.lighthouse,
            MIN_REPLICAS: str(self.min_replicas),
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ReplicaGroup | None:
        """This worker's group, or None outside a fault-tolerant launch. By default the process's environment as it
        is at the call (os.environ looked up then, not bound when this module was imported)."""
        environ = os.environ if environ is None else environ
        if GROUPS not in environ:
            return None
        return cls(int(environ[GROUP_ID]), int(environ[GROUPS]), environ[LIGHTHOUSE], int(environ[MIN_REPLICAS]))
