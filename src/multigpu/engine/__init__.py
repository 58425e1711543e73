"""The Engine and what it is made of. Its own observers are attached here, to every Engine built in the process:
the stuck-rank heartbeat, then the metrics monitor (engine.py imports neither; see multigpu.engine.observe)."""

from multigpu.engine.config import EngineConfig
from multigpu.engine.engine import Engine
from multigpu.engine.monitor import Monitor
from multigpu.engine.observe import StepObserver, StepStats, observe_every_engine
from multigpu.engine.progress import Heartbeat

observe_every_engine(Heartbeat)
observe_every_engine(Monitor)

__all__ = ["Engine", "EngineConfig", "StepObserver", "StepStats", "observe_every_engine"]
