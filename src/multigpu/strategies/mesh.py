"""How a strategy lays its processes out: degrees along named dimensions, and the DeviceMesh built from them.

ddp and zero1 replicate the model over every process, zero2/zero3 shard it over every process; hsdp
(replicate x shard) and 2-D parallelism (shard x tp) are layouts of the same four dimensions, so a new strategy
describes its layout here and the Engine, which only calls `strategy.setup`, does not change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from multigpu.core.errors import UsageError

#: Mesh dimensions outermost first. Ranks that differ only in the innermost dimension are neighbours (consecutive
#: ranks, so the same node), which is where tp's per-layer collectives must run; pp talks least, so it spans nodes.
MESH_ORDER = ("pp", "replicate", "shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    replicate: int = 1  # full model copies whose gradients are averaged (ddp)
    shard: int = 1  # processes that each hold a slice of parameters, gradients and optimizer states (zero2/zero3)
    tp: int = 1  # tensor parallel: each layer's matrices split across processes
    pp: int = 1  # pipeline parallel: consecutive groups of layers on different processes

    def __post_init__(self) -> None:
        for field in fields(self):
            degree = getattr(self, field.name)
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise UsageError(
                    f"The {field.name} degree must be a whole number of at least 1, not {degree!r}; "
                    f"set {field.name} to 1 or more."
                )

    @property
    def world_size(self) -> int:
        """The number of processes this layout needs."""
        return math.prod(getattr(self, field.name) for field in fields(self))

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step trains on: replicas and shards each read their own."""
        return self.replicate * self.shard

    def data_parallel_rank(self, rank: int) -> int:
        """Which of the data-parallel ranks global `rank` is: its index over (replicate, shard), as the mesh lays
        ranks out (MESH_ORDER, tp innermost, pp outermost)."""
        return (rank // self.tp) % self.data_parallel_size

    def layout(self, keep: Sequence[str] = ()) -> tuple[tuple[str, int], ...]:
        """(name, degree) of the mesh's dimensions, outermost first: those of degree above 1, and those in `keep`
        whatever their degree (a strategy keeps its own, so that `mesh["shard"]` works in a one-process run)."""
        unknown = [name for name in keep if name not in MESH_ORDER]
        if unknown:
            raise UsageError(f"Unknown mesh dimension(s) {unknown}; choose from {', '.join(MESH_ORDER)}.")
        return tuple((name, getattr(self, name)) for name in MESH_ORDER if getattr(self, name) > 1 or name in keep)

    @property
    def names(self) -> tuple[str, ...]:
        """The dimensions in use (degree above 1), outermost first."""
        return tuple(name for name, _ in self.layout())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(degree for _, degree in self.layout())

    def check(self, world_size: int) -> None:
        """Refuses a layout that does not use exactly the `world_size` processes launched."""
        if self.world_size != world_size:
            product = " x ".join(f"{field.name} {getattr(self, field.name)}" for field in fields(self))
            launched = f"{world_size} was" if world_size == 1 else f"{world_size} were"
            raise UsageError(
                f"{product} = {self.world_size} processes, but {launched} launched; launch {self.world_size} "
                f"(multigpu run -n {self.world_size}) or choose degrees whose product is {world_size}."
            )

    def build(self, device_type: str, keep: Sequence[str] = ()) -> DeviceMesh:
        """The DeviceMesh of this layout over the default process group, dimensions named as in `layout(keep)`.

        A dimension that spans every process reuses the default group (torch creates no communicator for it); any
        other dimension costs torch one new group per process, degree-1 dimensions in `keep` included.
        """
        if not dist.is_initialized():
            raise UsageError(
                "A DeviceMesh needs a process group, and none exists; create the Engine (which joins one) or call "
                "torch.distributed.init_process_group before building the mesh."
            )
        self.check(dist.get_world_size())
        dims = self.layout(keep)
        if not dims:
            raise UsageError(
                "Every degree is 1, so the mesh would have no dimension; name the dimension to keep, e.g. "
                "keep=('replicate',)."
            )
        shape, names = tuple(degree for _, degree in dims), tuple(name for name, _ in dims)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
