"""Strategy names -> strategy classes, and `build_strategy`, which builds the one a run asks for.

Adding a strategy is one file with a Strategy subclass (strategies/base.py) and one line in STRATEGY_CLASSES: the
Engine, the CLI's choices, config files and `multigpu demo` take it by name. Its constructor arguments are its
options: the fields of the option groups it inherits (core/layout.py, or its own file), and the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from multigpu.core.errors import UsageError
from multigpu.core.layout import resolve_layout
from multigpu.core.settings import StrategyOptions
from multigpu.strategies.base import Strategy
from multigpu.strategies.ddp import DDP
from multigpu.strategies.deepspeed import DeepSpeed
from multigpu.strategies.dp import DataParallel
from multigpu.strategies.fsdp import FSDP, Zero2
from multigpu.strategies.hsdp import HSDP
from multigpu.strategies.pp import PipelineParallel
from multigpu.strategies.single import Single
from multigpu.strategies.tp import TensorParallel
from multigpu.strategies.zero1 import Zero1

STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    "single": Single,
    "dp": DataParallel,
    "ddp": DDP,
    "zero1": Zero1,
    "zero2": Zero2,
    "zero3": FSDP,
    "fsdp": FSDP,
    "hsdp": HSDP,
    "tp": TensorParallel,
    "pp": PipelineParallel,
    "deepspeed": DeepSpeed,
}
STRATEGIES = ("auto", *STRATEGY_CLASSES)
#: What a degree asked for beside a strategy that does not take it is told; {takers}: the strategies that do.
NOT_BESIDE = {
    "tp": "tp_size splits layers alone (strategy tp) or beside the processes of {takers}, not {name}; choose one of "
    "those (ddp's whole replicas: hsdp with --replicate processes/tp_size) or drop tp_size.",
    "pp": "pp_size runs pipeline stages with {takers} inside them (or whole replicas with strategy pp), not {name}; "
    "choose one of those or drop pp_size.",
    "replicate": "replicate is {takers}'s number of replicas; drop it or use strategy {takers}, not {name}.",
}

__all__ = ["STRATEGIES", "STRATEGY_CLASSES", "Strategy", "build_strategy"]


def build_strategy(
    name: str, settings: Any, world: int, nodes: int = 1, say: Callable[[str], None] = print
) -> Strategy:
    """The strategy `name` for a run's settings (an EngineConfig) on `world` processes over `nodes` machines: its
    layout resolved, built from its own options; a strategy that runs beside pp_size inside a pipeline. One sentence
    refuses what it cannot run."""
    if name not in STRATEGY_CLASSES:
        raise UsageError(f"Unknown strategy {name!r}; choose one of {', '.join(STRATEGY_CLASSES)}.")
    cls = STRATEGY_CLASSES[name]
    asked = {"tp": settings.tp_size, "pp": settings.pp_size, "replicate": settings.replicate}
    for dim, degree in asked.items():  # composition is a rule over the layout: which degrees a strategy takes
        if degree not in (None, 1) and dim not in cls.spread.takes:
            takers = _either(n for n, c in _unaliased() if dim in c.spread.takes and dim not in c.spread.fills)
            raise UsageError(NOT_BESIDE[dim].format(takers=takers, name=name))
    layout = resolve_layout(settings, cls.spread, world, nodes, name)
    piped = layout.pp > 1 and not cls.pipelined
    _refuse_options_not_taken(name, [cls, *([PipelineParallel] if piped else [])], settings)
    strategy = cls.build(say, layout=layout, **_options(cls, settings))
    return PipelineParallel(layout=layout, data=strategy, **_options(PipelineParallel, settings)) if piped else strategy


def _options(cls: type[Strategy], settings: Any) -> dict[str, Any]:
    """The settings `cls` is built from: its fields that are settings."""
    return {f.name: getattr(settings, f.name) for f in fields(cls) if f.name != "layout" and hasattr(settings, f.name)}


def _refuse_options_not_taken(name: str, classes: list[type[Strategy]], settings: Any) -> None:
    """Refuses a strategy option (a field of a StrategyOptions group) set for a strategy that does not take it."""
    taken = {f.name for cls in classes for f in fields(cls)}
    for group in {g for cls in STRATEGY_CLASSES.values() for g in cls.__mro__ if StrategyOptions in g.__bases__}:
        for option in fields(group):
            if option.name not in taken and getattr(settings, option.name) != option.default:
                takers = _either(n for n, c in _unaliased() if issubclass(c, group))
                via_pp = " (and zero2, zero3 or hsdp beside pp_size)" if issubclass(PipelineParallel, group) else ""
                raise UsageError(
                    f"{option.name} is an option of strategy {takers}{via_pp}, not of {name}; drop it, or choose "
                    f"{takers}."
                )


def _unaliased() -> list[tuple[str, type[Strategy]]]:
    """(name, class) of each strategy once: the first name of a class registered under two (zero3, fsdp)."""
    return list({cls: (name, cls) for name, cls in reversed(STRATEGY_CLASSES.items())}.values())[::-1]


def _either(names: Iterable[str]) -> str:
    """ "a", "a or b", "a, b or c"."""
    names = list(names)
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
