"""A strategy of a test's own, whole in this one file: DDP's wrapping with zero1's sharded optimizer states as its
facts, and no shared GPUs. tests/strategies/test_described.py registers it and finds it planned, simulated and
benched from these facts alone."""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.strategies.ddp import DDP
from multigpu.strategies.facts import (
    ALL_REDUCE,
    DATA_PARALLEL,
    GRAD_BUCKET,
    ONE_GPU,
    Communication,
    Facts,
    MemoryModel,
    PlanRow,
)


@dataclass
class Own(DDP):
    name = "own"
    facts = Facts(
        MemoryModel(frozenset({"optimizer"}), temporary=GRAD_BUCKET),
        Communication(ALL_REDUCE, gathers_after_step=True),
    )
    plan_rows = (PlanRow(order=2, shown=frozenset({ONE_GPU, DATA_PARALLEL}), recommended=frozenset({DATA_PARALLEL})),)
    composes_with = DDP.composes_with - {"shared_gpus"}  # its collectives are not all gloo runs on CUDA tensors
