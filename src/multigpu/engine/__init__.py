"""The Engine and what it is made of. Its own observers are attached here, to every Engine built in the process:
the stuck-rank heartbeat, the metrics monitor, then torch.compile's report (engine.py imports none of them; see
multigpu.observers.observe).

The public names are imported on first use: the launcher reads observers.progress's NCCL helpers, and must not pay for
the Engine, its strategies and their imports on every `multigpu run`.
"""

from typing import Any

from multigpu.core.lazy import imported
from multigpu.observers.observe import StepObserver, StepStats, observe_every_engine


def _heartbeat() -> StepObserver:
    from multigpu.observers.progress import Heartbeat

    return Heartbeat()


def _monitor() -> StepObserver:
    from multigpu.observers.monitor import Monitor

    return Monitor()


def _compile_report() -> StepObserver:
    from multigpu.observers.compile_report import CompileReport

    return CompileReport()


observe_every_engine(_heartbeat)
observe_every_engine(_monitor)
observe_every_engine(_compile_report)

_PUBLIC = {
    "Engine": "multigpu.engine.engine",
    "EngineConfig": "multigpu.engine.config",
    "Monitor": "multigpu.observers.monitor",
}

__all__ = ["Engine", "EngineConfig", "StepObserver", "StepStats", "observe_every_engine"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'multigpu.engine' has no attribute {name!r}")
    return imported(f"{_PUBLIC[name]}:{name}")
