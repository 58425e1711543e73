"""torch.compile of a model's blocks, and what it did: the graphs of the first step, then each compilation after it,
reported as it happens, so that a run that compiles again and again is seen, not just slow."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from multigpu.core.modules import stop_caching
from multigpu.engine.observe import StepObserver, StepStats


def compile_blocks(model: nn.Module, blocks: Iterable[nn.Module], backend: str) -> None:
    """Compiles each of `model`'s blocks in place (its parameters keep their names; FSDP's hooks, registered on the
    block, stay out of the graph, as dynamo skips them). A shape that changes compiles once more and is dynamic from
    then on (torch's automatic dynamic shapes), so a shorter last batch or sequences of many lengths compile twice,
    not once per shape. Past torch's limit of compilations per block, dynamo would quietly run the block
    uncompiled; here it raises instead."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if backend == "inductor" and torch._C._get_cpu_capability() == "DEFAULT":
        # aten runs without vector instructions (ATEN_CPU_CAPABILITY=default): inductor then builds its C++ kernels
        # without the vector headers, and torch 2.13 still emits vector code into them, which does not compile.
        from torch._inductor import config as inductor  # imported by compile anyway; not by every Engine

        inductor.cpp.simdlen = 1
    stop_caching(model)  # a Hugging Face model's cache would compile every layer apart (see stop_caching)
    for block in blocks:
        block.compile(backend=backend)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (forward and backward each count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class CompileReport(StepObserver):
    """Says, on the main process, how many graphs the first step compiled and when a later step compiled more."""

    def attach(self, engine: Any) -> None:
        self._say = engine.print if engine.config.compile else None
        self._graphs = compiled_graphs()

    def on_step_end(self, stats: StepStats) -> None:
        if self._say is None or compiled_graphs() == self._graphs:
            return
        graphs, self._graphs = compiled_graphs() - self._graphs, compiled_graphs()
        if stats.step == 1:
            self._say(f"torch.compile: {graphs} graph(s) in the first step ({stats.seconds:.1f} s with compilation)")
        else:
            self._say(
                f"torch.compile compiled {graphs} more graph(s) in step {stats.step}: an input's shape changed (a "
                "shorter last batch, another sequence length), and that dimension is dynamic from now on."
            )
