"""What torch.compile did: the graphs of the first step, then each compilation after it,
reported as it happens, so that a run that compiles again and again is seen, not just slow."""

from __future__ import annotations

from typing import Any

from multigpu.observers.observe import StepObserver, StepStats, leave_out
from multigpu.transforms.compile import compiled_graphs


class CompileReport(StepObserver):
    """Says, on the main process, how many graphs the first step compiled and when a later step compiled more."""

    def attach(self, engine: Any) -> None:
        self._say = engine.print if engine.config.compile else None
        if self._say is None:  # nothing compiled, nothing to report: no hook on every step, and torch._dynamo
            leave_out(self, "on_step_end")  # (half a second to import) left to what needs it
            return
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
                "shorter last batch, another sequence length), and that dimension is dynamic from now on (zero2, "
                "zero3 and hsdp with tp_size compile each new shape instead)."
            )
