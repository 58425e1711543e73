"""torch.compile of a model's blocks, in place, and the count of graphs it made."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from multigpu.transforms.modules import stop_caching


def compile_blocks(model: nn.Module, blocks: Iterable[nn.Module], backend: str, static: bool = False) -> None:
    """Compiles each of `model`'s blocks in place (its parameters keep their names; FSDP's hooks, registered on the
    block, stay out of the graph, as dynamo skips them). A shape that changes compiles once more and is dynamic from
    then on (torch's automatic dynamic shapes), so a shorter last batch or sequences of many lengths compile twice,
    not once per shape; `static`: every new shape compiles once more instead. Past torch's limit of compilations
    per block, dynamo would quietly run the block uncompiled; here it raises instead."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if backend == "inductor" and torch._C._get_cpu_capability() == "DEFAULT":
        # aten runs without vector instructions (ATEN_CPU_CAPABILITY=default): inductor then builds its C++ kernels
        # without the vector headers, and torch 2.13 still emits vector code into them, which does not compile.
        from torch._inductor import config as inductor  # imported by compile anyway; not by every Engine

        inductor.cpp.simdlen = 1
    stop_caching(model)  # a Hugging Face model's cache would compile every layer apart (see stop_caching)
    for block in blocks:
        block.compile(backend=backend, dynamic=False if static else None)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (forward and backward each count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
