"""What a strategy is, as data its class declares (Strategy.facts, Strategy.plan_rows): what it shards and what it
replicates, what a rank holds for the planner, what it communicates for the simulator, and what it can run. The
planner, the simulator, bench and the Engine's checks read these instead of knowing strategies by name, so that a
new strategy is planned, simulated and benched from its own file."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The model states a data-parallel strategy may shard across its ranks; the others it replicates.
STATES = frozenset({"params", "grads", "optimizer"})

# What a rank holds beside its model states (planner/memory.py counts each).
AUTOCAST = "autocast"  # autocast's 16-bit copy of every weight it casts, kept until backward
GRAD_BUCKET = "grad_bucket"  # DDP's flat bucket copy of every gradient, and autocast's copies
GATHERED_MODEL = "gathered_model"  # every parameter gathered from forward to backward (zero2)
TWO_UNITS = "two_units"  # the unit in use and the next one, prefetched (zero3)

# How a model built under engine.init_module() materialises (planner/setup_memory.py).
WHOLE = "whole"  # every rank builds the whole model
FSDP_SLICES = "fsdp_slices"  # fully_shard copies each rank's slices out; on meta, a rank materialises its shards
PARTITIONED = "partitioned"  # DeepSpeed's zero.Init partitions each parameter as it is created

# The gradient collective of a data-parallel step.
ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"

# The plans a planner row is shown in (and may be recommended in).
ONE_GPU = "one GPU"
DATA_PARALLEL = "several GPUs"  # data parallelism alone
BESIDE_MODEL_PARALLEL = "beside tp or pp"  # data parallelism beside tp_size or pp_size
MODEL_PARALLEL = "tp or pp alone"  # tp x pp takes every GPU


@dataclass(frozen=True)
class MemoryModel:
    """What a rank holds, for the planner: which model states are sharded over the data-parallel ranks (each rank
    holding 1/n), what it holds beside them, and where they live."""

    sharded: frozenset[str] = frozenset()
    #: DeepSpeed's flat partitions: states divided evenly by n, beside an fp32 master partition of the weights;
    #: else FSDP's per-tensor shards (planner/states.py: sharded_states).
    partitions: bool = False
    temporary: str = AUTOCAST
    offload: bool = False  # the sharded states live in host memory
    build: str = WHOLE
    #: Shards inside each replica only (hsdp), the replicas holding them whole; else over every data-parallel rank.
    shards_within_replica: bool = False

    @property
    def replicated(self) -> frozenset[str]:
        return STATES - self.sharded


@dataclass(frozen=True)
class Communication:
    """A data-parallel step's collectives, for the simulator (planner/simulate.py)."""

    gradients: str = ALL_REDUCE  # reduced in buckets as backward makes them, or per unit (per_unit)
    #: Each unit gathered for forward and again for backward, its gradients scattered in backward (zero3).
    per_unit: bool = False
    gathers_after_step: bool = False  # the updated shards all-gathered after the optimizer step (zero1, zero2)
    across_replicas: bool = False  # each gradient shard also all-reduced across replicas, one per node (hsdp)


@dataclass(frozen=True)
class Facts:
    """A strategy's class-level description."""

    memory: MemoryModel = field(default_factory=MemoryModel)
    #: None: no data-parallel gradient collective of its own (single, dp, tp; pp's is its inner strategy's).
    communication: Communication | None = None
    reduces_gradients: bool = True  # across processes (tp splits layers and reduces none)
    one_process: bool = False  # runs in one process, with no process group
    optional: bool = False  # an optional backend: planned and reported, never recommended
    #: Its optimizer steps flat partitions of many parameters, which optimizers that update whole matrices refuse.
    flat_partitions: bool = False

    @property
    def offloads(self) -> bool:
        return self.memory.offload


@dataclass(frozen=True)
class PlanRow:
    """A row the planner shows for a strategy: `label` ({name}: the name it is registered under), the strategy
    options it runs with, its memory model (None: the strategy's own), its place fastest first, and the plans that
    show and may recommend it."""

    label: str = "{name}"
    options: tuple[tuple[str, Any], ...] = ()
    memory: MemoryModel | None = None
    order: int = 0
    shown: frozenset[str] = frozenset()
    recommended: frozenset[str] = frozenset()
    #: The row a mixture is shown at every ep degree, and whose layout is the planner's data parallelism.
    reference: bool = False
