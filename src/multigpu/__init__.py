"""multigpu: one training loop, any number of GPUs and machines, the same numbers."""

from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.core.precision import PRECISIONS
from multigpu.core.schedule import SampleSchedule, warmup_cosine
from multigpu.engine import Engine, EngineConfig, StepObserver, StepStats
from multigpu.planner import plan
from multigpu.strategies import STRATEGIES

__version__ = "0.1.0"
__all__ = [
    "PRECISIONS",
    "STRATEGIES",
    "DistEnv",
    "Engine",
    "EngineConfig",
    "SampleSchedule",
    "StepObserver",
    "StepStats",
    "UsageError",
    "__version__",
    "plan",
    "warmup_cosine",
]
