"""HSDP (hybrid sharding): zero3 inside each group of processes, whole replicas across the groups.

Parameters, gradients and optimizer states are sharded over the processes of one replica (by default a node, where
the all-gathers of every layer run over the fast links), and each replica's reduce-scattered gradients are then
averaged with the other replicas' (one all-reduce of a shard per step over the slower links between nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from multigpu.core.errors import UsageError
from multigpu.strategies.fsdp import FSDP
from multigpu.strategies.mesh import ParallelDims


@dataclass
class HSDP(FSDP):
    #: How many whole replicas; each shards the model over world_size / replicate processes. None: one per node.
    replicate: int | None = None

    mesh_dims = ("replicate", "shard")

    @property
    def name(self) -> str:  # type: ignore[override]
        return "hsdp"

    def parallel_dims(self, world_size: int) -> ParallelDims:
        replicate, groups = self.replicate or 1, self.outside_tp(world_size)
        if groups % replicate:
            divisors = [d for d in range(1, groups + 1) if groups % d == 0]
            of_tp = f" groups of tp {self.tp}" if self.tp > 1 else " processes"
            raise UsageError(
                f"hsdp cannot split {groups}{of_tp} into {replicate} equal replicas; choose a replicate "
                f"degree that divides {groups} ({', '.join(map(str, divisors))})."
            )
        return ParallelDims(replicate=replicate, shard=groups // replicate, tp=self.tp)

    def sharding_mesh(self) -> DeviceMesh:
        return self.mesh["replicate", "shard"]  # fully_shard reads a 2-D (replicate, shard) mesh as HSDP
