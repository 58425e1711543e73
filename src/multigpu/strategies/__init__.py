"""Strategy names -> strategy classes, and `build_strategy`, which builds the one a run asks for.

Adding a strategy is one file with a Strategy subclass (strategies/base.py) and one line in STRATEGY_CLASSES (its
name, and where its class is): the Engine, the CLI's choices, config files and `multigpu demo` take it by name; the
planner, the simulator and bench read what its class declares of itself (strategies/facts.py: `facts`, `plan_rows`). Its
constructor arguments are its options, the fields of the option groups it inherits (config/layout.py, or its own
file), and the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from multigpu.config.layout import resolve_layout
from multigpu.config.settings import strategy_option_fields
from multigpu.core.errors import UsageError
from multigpu.core.lazy import imported
from multigpu.strategies.base import Strategy

#: Each strategy's class, imported when a run uses it: pp's imports torch's pipelining (and dynamo), fsdp's FSDP2,
#: which a process running another strategy (or the CLI, which only checks) need not pay for.
STRATEGY_CLASSES: dict[str, str] = {
    "single": "multigpu.strategies.single:Single",
    "dp": "multigpu.strategies.dp:DataParallel",
    "ddp": "multigpu.strategies.ddp:DDP",
    "zero1": "multigpu.strategies.zero1:Zero1",
    "zero2": "multigpu.strategies.fsdp:Zero2",
    "zero3": "multigpu.strategies.fsdp:FSDP",
    "fsdp": "multigpu.strategies.fsdp:FSDP",
    "hsdp": "multigpu.strategies.hsdp:HSDP",
    "tp": "multigpu.strategies.tp:TensorParallel",
    "pp": "multigpu.strategies.pp:PipelineParallel",
    "deepspeed": "multigpu.strategies.deepspeed:DeepSpeed",
}
STRATEGIES = ("auto", *STRATEGY_CLASSES)
#: What a degree asked for beside a strategy that does not take it is told; {takers}: the strategies that do.
NOT_BESIDE = {
    "tp": "tp_size splits layers alone (strategy tp) or beside the processes of {takers}, not {name}; choose one of "
    "those (ddp's whole replicas: hsdp with --replicate processes/tp_size) or drop tp_size.",
    "pp": "pp_size runs pipeline stages with {takers} inside them (or whole replicas with strategy pp), not {name}; "
    "choose one of those or drop pp_size.",
    "replicate": "replicate is {takers}'s number of replicas; drop it or use strategy {takers}, not {name}.",
    "cp": "cp_size splits each sequence beside the processes of {takers}, not {name}; choose one of those or drop "
    "cp_size.",
    "ep": "ep_size spreads experts over the data-parallel processes of {takers}, not {name}; choose one of those or "
    "drop ep_size.",
}

__all__ = ["STRATEGIES", "STRATEGY_CLASSES", "Strategy", "build_strategy", "strategy_class"]


def strategy_class(name: str) -> type[Strategy]:
    """The class registered as `name`, imported now."""
    return imported(STRATEGY_CLASSES[name])


def drives_gpus_in_process(name: str | None) -> bool:
    """Whether the strategy registered as `name` drives every GPU from one process (dp): one process is launched."""
    return name in STRATEGY_CLASSES and strategy_class(name).spread.gpus_in_process


def lays_out_along(name: str | None, dim: str) -> bool:
    """Whether the strategy registered as `name` lays its own processes along the mesh dimension `dim` (tp: every
    process splits every layer; pp: a pipeline), whatever degrees a run asks for beside it."""
    return name in STRATEGY_CLASSES and dim in strategy_class(name).spread.fills


def plain_single_process(name: str | None) -> bool:
    """Whether `name` is a one-process strategy on one device (single): a run with nothing to spread."""
    return name in STRATEGY_CLASSES and strategy_class(name).facts.one_process and not drives_gpus_in_process(name)


def __getattr__(name: str) -> Any:
    """A registered class by its own name (`multigpu.strategies.DDP`), imported on first use."""
    for path in STRATEGY_CLASSES.values():
        if path.endswith(f":{name}"):
            return imported(path)
    raise AttributeError(f"module 'multigpu.strategies' has no attribute {name!r}")


def build_strategy(
    name: str, settings: Any, world: int, nodes: int = 1, say: Callable[[str], None] = print
) -> Strategy:
    """The strategy `name` for a run's settings (an EngineConfig) on `world` processes over `nodes` machines: its
    layout resolved, built from its own options; a strategy that runs beside pp_size inside a pipeline. One sentence
    refuses what it cannot run."""
    if name not in STRATEGY_CLASSES:
        raise UsageError(f"Unknown strategy {name!r}; choose one of {', '.join(STRATEGY_CLASSES)}.")
    cls = strategy_class(name)
    asked = {
        "tp": settings.tp_size,
        "pp": settings.pp_size,
        "replicate": settings.replicate,
        "cp": settings.cp_size,
        "ep": settings.ep_size,
    }
    for dim, degree in asked.items():  # composition is a rule over the layout: which degrees a strategy takes
        if degree not in (None, 1) and dim not in cls.spread.takes:
            takers = _either(n for n, c in _unaliased() if dim in c.spread.takes and dim not in c.spread.fills)
            raise UsageError(NOT_BESIDE[dim].format(takers=takers, name=name))
    layout = resolve_layout(settings, cls.spread, world, nodes, name)
    pipeline = strategy_class("pp") if layout.pp > 1 and not cls.pipelined else None
    _refuse_options_not_taken(name, [cls, *([pipeline] if pipeline else [])], settings)
    strategy = cls.build(say, layout=layout, **_options(cls, settings))
    return pipeline(layout=layout, inner=strategy, **_options(pipeline, settings)) if pipeline else strategy


def _options(cls: type[Strategy], settings: Any) -> dict[str, Any]:
    """The settings `cls` is built from: its fields that are settings."""
    return {f.name: getattr(settings, f.name) for f in fields(cls) if f.name != "layout" and hasattr(settings, f.name)}


def _refuse_options_not_taken(name: str, classes: list[type[Strategy]], settings: Any) -> None:
    """Refuses a strategy option (a field of a StrategyOptions group) set for a strategy that does not take it."""
    taken = {f.name for cls in classes for f in fields(cls) if f.name not in cls.not_taken}
    for group, option in strategy_option_fields():
        if option.name not in taken and getattr(settings, option.name) != option.default:
            takers = _either(n for n, c in _unaliased() if issubclass(c, group) and option.name not in c.not_taken)
            via_pp = " (and zero2, zero3 or hsdp beside pp_size)" if issubclass(strategy_class("pp"), group) else ""
            raise UsageError(
                f"{option.name} is an option of strategy {takers}{via_pp}, not of {name}; drop it, or choose {takers}."
            )


def _unaliased() -> list[tuple[str, type[Strategy]]]:
    """(name, class) of each strategy once, imported: the first name of a class registered under two (zero3, fsdp).
    Only a refusal needs them all, to name the strategies that take what was refused."""
    classes = [(name, strategy_class(name)) for name in STRATEGY_CLASSES]
    return list({cls: (name, cls) for name, cls in reversed(classes)}.values())[::-1]


def _either(names: Iterable[str]) -> str:
    """ "a", "a or b", "a, b or c"."""
    names = list(names)
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
