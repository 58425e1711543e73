"""multigpu: one training loop, any number of GPUs and machines, the same numbers."""

from typing import Any

from multigpu.core.lazy import imported

# Where each public name lives. They are imported on first use, not here: a process that imports one module of the
# package (a worker of `multigpu run`, before the user's script) must not pay for, or be changed by, the rest.
_PUBLIC = {
    "DistEnv": "multigpu.core.env",
    "UsageError": "multigpu.core.errors",
    "PRECISIONS": "multigpu.config.precision",
    "RandomWindows": "multigpu.data.random_windows",
    "SampleSchedule": "multigpu.engine.lr_schedule",
    "warmup_cosine": "multigpu.engine.lr_schedule",
    "Engine": "multigpu.engine",
    "EngineConfig": "multigpu.engine",
    "StepObserver": "multigpu.engine",
    "StepStats": "multigpu.engine",
    "plan": "multigpu.planner",
    "STRATEGIES": "multigpu.strategies",
}

__version__ = "0.1.0"
__all__ = [
    "PRECISIONS",
    "STRATEGIES",
    "DistEnv",
    "Engine",
    "EngineConfig",
    "RandomWindows",
    "SampleSchedule",
    "StepObserver",
    "StepStats",
    "UsageError",
    "__version__",
    "plan",
    "warmup_cosine",
]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'multigpu' has no attribute {name!r}")
    return imported(f"{_PUBLIC[name]}:{name}")
