"""HSDP (hybrid sharding): zero3 inside each group of processes, whole replicas across the groups.

Parameters, gradients and optimizer states are sharded over the processes of one replica (by default a node, where
the all-gathers of every layer run over the fast links), and each replica's reduce-scattered gradients are then
averaged with the other replicas' (one all-reduce of a shard per step over the slower links between nodes). How
many replicas is the layout's replicate degree (config/layout.py: --replicate, by default one per node).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from multigpu.config.layout import HYBRID
from multigpu.parallel.mesh import with_cp
from multigpu.strategies.facts import (
    BESIDE_MODEL_PARALLEL,
    REDUCE_SCATTER,
    STATES,
    TWO_UNITS,
    Communication,
    Facts,
    MemoryModel,
    PlanRow,
)
from multigpu.strategies.fsdp import FSDP


@dataclass
class HSDP(FSDP):
    spread = HYBRID
    # Its plain build is whole: setup's peak is counted as such (planner/setup_memory.py).
    facts = Facts(
        MemoryModel(STATES, temporary=TWO_UNITS, shards_within_replica=True),
        Communication(REDUCE_SCATTER, per_unit=True, across_replicas=True),
    )
    plan_rows = (
        PlanRow(order=5, shown=frozenset({BESIDE_MODEL_PARALLEL}), recommended=frozenset({BESIDE_MODEL_PARALLEL})),
    )
    mesh_dims = ("replicate", "shard")

    @property
    def name(self) -> str:  # type: ignore[override]
        return "hsdp"

    def sharding_mesh(self, mesh: DeviceMesh | None = None) -> DeviceMesh:
        return with_cp(mesh or self.mesh, ("replicate", "shard"))  # fully_shard reads a 2-D mesh as HSDP
