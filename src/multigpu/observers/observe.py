"""The Engine's observer seam: what watches a training run attaches here, and the Engine imports none of it.

An observer sees each engine op (forward, backward, the optimizer step, every collective and checkpoint), the end
of every optimizer step with its figures, and every record the loop logs. The Engine's own observers (the
stuck-rank heartbeat and the metrics monitor) are registered by `multigpu.engine`'s package face; `multigpu bench`
and `multigpu verify` register their recorder in the worker that runs a script (multigpu.tools.harness); a script
can pass its own to `Engine(observers=[...])`. Registered factories make observers for every Engine built
afterwards in the process, in registration order; observers passed to the Engine come last.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

#: The Engine's settings (an EngineConfig), passed through `configure`: named here without importing the engine,
#: which imports this module.
Config = TypeVar("Config")


@dataclass(frozen=True)
class StepStats:
    """One optimizer step, as every rank saw it."""

    step: int  # optimizer steps finished, this one included (carried on over a resume)
    seconds: float  # wall time since the previous step ended
    samples: int  # real samples in the global batch (batches from engine.dataloader; else 0)
    tokens: float  # units summed over all ranks when backward got count= (tokens), else 0
    busy_s: float  # this rank's data loading and forward: the time outside backward and the optimizer step
    timed: bool  # nothing but training ran inside it (no checkpoint, evaluation or FLOP count)
    loss: float | None  # the global batch's loss, when an observer wants it (wants_loss)
    applied: bool  # False when fp16 loss scaling skipped the update


class StepObserver:
    """Every hook is a no-op here: override the ones you need. Hooks run on every rank, in step."""

    wants_loss = False  # the engine all-reduces each step's global loss (one more scalar) for StepStats.loss
    synchronizes = False  # the engine waits for the device's queued work before it times each step

    def configure(self, config: Config) -> Config:
        """The Engine's settings before anything is built from them; return them changed to override them."""
        return config

    def attach(self, engine: Any) -> None:
        """`engine` (a multigpu.Engine: not imported here, as it imports this module) is built, process group joined,
        strategy chosen unless auto, and this observer is its own."""

    def on_setup(self, model: nn.Module) -> None:
        """engine.setup wrapped `model` (the model the script trains from now on)."""

    def watch(self, op: str) -> contextlib.AbstractContextManager[None]:
        """Entered around each engine op: "forward", "backward", "optimizer step", "save", "reduce", ..."""
        return contextlib.nullcontext()

    def on_backward_start(self) -> None:
        """A micro-step's backward is about to run."""

    def on_backward_end(self) -> None:
        """A micro-step's backward has run."""

    def on_step_end(self, stats: StepStats) -> None:
        """An optimizer step ended (applied or skipped); the next step's timing has begun."""

    def on_log(self, step: int, record: dict[str, Any]) -> None:
        """The loop logged `record` at `step` through engine.log (called on the main process only)."""

    def on_resume(self, step: int) -> None:
        """A checkpoint was loaded: the count of optimizer steps goes on from `step`."""

    def on_config(self, config: Mapping[str, Any]) -> None:
        """The script handed its whole resolved configuration to engine.log_config (main process only)."""

    def on_close(self) -> None:
        """engine.close() was called: the run is over; flush and finish what the observer opened."""


_FACTORIES: list[Callable[[], StepObserver]] = []


def observe_every_engine(factory: Callable[[], StepObserver]) -> None:
    """Every Engine built from now on in this process gets an observer from `factory`."""
    _FACTORIES.append(factory)


def new_observers() -> list[StepObserver]:
    """One observer from each registered factory, in registration order: what a new Engine starts with."""
    return [factory() for factory in _FACTORIES]


def overriding(observers: list[StepObserver], hook: str) -> list[StepObserver]:
    """The `observers` whose `hook` does something: those that override StepObserver's no-op. The Engine calls each
    hook on these only, found once, as every step calls its hooks (a few microseconds each, per op)."""
    nothing = getattr(StepObserver, hook)
    return [observer for observer in observers if getattr(getattr(observer, hook), "__func__", None) is not nothing]


def leave_out(observer: StepObserver, *hooks: str) -> None:
    """Makes `hooks` StepObserver's no-ops on `observer` for this run, where the feature they serve is off: the
    Engine calls each hook on the observers that override it only (Hooks), so it then never calls them."""
    for hook in hooks:
        setattr(observer, hook, getattr(StepObserver, hook).__get__(observer))


class Hooks:
    """The per-step hooks of an Engine's observers, each called on the observers that override it (found as the
    Engine starts, and again once set up): a base class's no-op costs a call per observer on every op of every step.
    An observer added to engine.observers later sees the other hooks only."""

    def __init__(self, observers: list[StepObserver]) -> None:
        self.watchers = overriding(observers, "watch")
        self._starts = overriding(observers, "on_backward_start")
        self._ends = overriding(observers, "on_backward_end")
        self._steps = overriding(observers, "on_step_end")

    def backward_start(self) -> None:
        for observer in self._starts:
            observer.on_backward_start()

    def backward_end(self) -> None:
        for observer in self._ends:
            observer.on_backward_end()

    def step_end(self, stats: StepStats) -> None:
        for observer in self._steps:
            observer.on_step_end(stats)


_NOTHING = contextlib.nullcontext()  # stateless: one serves every op that no observer watches


def watching(observers: list[StepObserver], op: str) -> contextlib.AbstractContextManager[None]:
    """All `observers`' watch(op) at once, entered in order and left in reverse. One observer's (the heartbeat's,
    usually) is returned as it is: an ExitStack around it would cost more than the watch itself."""
    if len(observers) == 1:
        return observers[0].watch(op)
    return _all_watching(observers, op) if observers else _NOTHING


@contextlib.contextmanager
def _all_watching(observers: list[StepObserver], op: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for observer in observers:
            stack.enter_context(observer.watch(op))
        yield


def watched(observers: list[StepObserver], op: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, called inside every observer's watch(op); `function` itself where none watches."""
    if not observers:
        return function

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with watching(observers, op):
            return function(*args, **kwargs)

    return call


class Reporting:
    """The Engine's calls that hand what a run reports to its observers (a base class of Engine)."""

    observers: list[StepObserver]
    is_main_process: bool

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Hands `record` to the observers on the main process: the monitor writes it to log_dir's metrics.jsonl
        and the trackers of log_to (TensorBoard by default; nothing without log_dir)."""
        if self.is_main_process:
            for observer in self.observers:
                observer.on_log(step, record)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Hands a recipe's or script's whole resolved configuration (plain values, nested mappings allowed) to the
        experiment trackers of log_to: W&B's run config, MLflow's params. Main process only; nothing without
        log_dir. The Engine's own settings are logged at its start, under "engine"."""
        if self.is_main_process:
            for observer in self.observers:
                observer.on_config(config)

    def close(self) -> None:
        """Ends the run's logging on this process: flushes metrics.jsonl and finishes the trackers' runs (W&B,
        MLflow). Without it they are closed at exit; call it to read them back, or to start another run."""
        for observer in self.observers:
            observer.on_close()
