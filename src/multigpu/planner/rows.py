"""The planner's rows, enumerated from the strategy registry: each registered strategy's `plan_rows`
(strategies/facts.py), labelled by the name it is registered under, fastest first. The planner and the simulator
read a row's facts here rather than knowing strategies by name."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from multigpu.config.layout import Spread
from multigpu.core.errors import UsageError
from multigpu.strategies import STRATEGY_CLASSES, Strategy, strategy_class
from multigpu.strategies.facts import Facts, MemoryModel, PlanRow


@dataclass(frozen=True)
class Row:
    """One row of the plan: its label, the strategy it runs (as registered) with its options, and its facts."""

    label: str
    strategy: str
    options: dict[str, Any]
    memory: MemoryModel
    facts: Facts
    spread: Spread
    plan: PlanRow

    @property
    def offloads(self) -> bool:
        return self.memory.offload


def rows() -> dict[str, Row]:
    """Every planner row by label, fastest first; a class registered under two names (zero3, fsdp) once, under its
    first. Read anew when the registry changes (a test registers its own strategy)."""
    return _rows(tuple(STRATEGY_CLASSES.items()))


@functools.cache
def _rows(registry: tuple[tuple[str, str], ...]) -> dict[str, Row]:
    seen: set[type[Strategy]] = set()
    found: list[Row] = []
    for name, _ in registry:
        cls = strategy_class(name)
        if cls in seen:
            continue
        seen.add(cls)
        for plan in cls.plan_rows:
            memory = plan.memory or cls.facts.memory
            label = plan.label.format(name=name)
            found.append(Row(label, name, dict(plan.options), memory, cls.facts, cls.spread, plan))
    return {row.label: row for row in sorted(found, key=lambda row: row.plan.order)}


def row(label: str) -> Row:
    """The row `label` (a planner label such as zero3+offload, or a strategy's name)."""
    found = rows()
    if label not in found:
        raise UsageError(f"Unknown planner row {label!r}; the planner has {', '.join(found)}.")
    return found[label]


def shown_in(plan: str) -> tuple[str, ...]:
    """The rows a plan (strategies/facts.py: ONE_GPU, DATA_PARALLEL, ...) shows, fastest first."""
    return tuple(label for label, r in rows().items() if plan in r.plan.shown)


def recommended_in(plan: str) -> tuple[str, ...]:
    """The rows a plan may recommend, fastest first: never an optional backend's."""
    return tuple(label for label, r in rows().items() if plan in r.plan.recommended and not r.facts.optional)


def reference() -> str:
    """The row whose layout is the planner's data parallelism, and which a mixture is shown at every ep degree."""
    return next(label for label, r in rows().items() if r.plan.reference)


def strategy_facts(name: str) -> Facts:
    """A registered strategy's facts (its class imported now)."""
    return strategy_class(name).facts


def simulated() -> tuple[str, ...]:
    """The registered strategies the simulator models: those with a data-parallel gradient collective."""
    return tuple(name for name in STRATEGY_CLASSES if strategy_facts(name).communication is not None)


def hybrid() -> str | None:
    """The first simulated strategy that shards inside a node and replicates across nodes (None: none is)."""
    communications = ((name, strategy_facts(name).communication) for name in simulated())
    return next((name for name, c in communications if c is not None and c.across_replicas), None)
