"""multigpu: one training loop, any number of GPUs and machines, the same numbers."""

from multigpu.engine import Engine, EngineConfig
from multigpu.env import DistEnv
from multigpu.errors import UsageError
from multigpu.planner import plan
from multigpu.precision import PRECISIONS
from multigpu.strategies import STRATEGIES

__version__ = "0.1.0"
__all__ = ["PRECISIONS", "STRATEGIES", "DistEnv", "Engine", "EngineConfig", "UsageError", "__version__", "plan"]
