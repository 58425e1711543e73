"""The Engine's settings: EngineConfig is every group of settings the Engine reads, each defined once in the lowest
layer that reads it (config/settings.py says how), and the few that only the Engine reads. `multigpu demo` maps them
flag for flag; train, finetune, plan, bench, verify and simulate show them in their own configs, a group at a time
(`shown_group(EngineConfig, ...)`, `override_group`) or one at a time where a verb shows one otherwise
(`shown(EngineConfig, default=...)`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from multigpu.config.layout import LayoutSettings, ShardingOptions, TensorParallelOptions
from multigpu.config.optimizer import OptimizerSettings
from multigpu.config.pipeline import PipelineOptions
from multigpu.config.settings import ComputeSettings, Settings, TrainingSettings, setting
from multigpu.core.env import BACKENDS
from multigpu.core.errors import UsageError, require
from multigpu.observers.trackers import parse_log_to
from multigpu.parallel.compression import CompressionOptions
from multigpu.strategies import STRATEGIES
from multigpu.strategies.compatibility import check_settings
from multigpu.strategies.ddp import DDPOptions
from multigpu.strategies.deepspeed import DeepSpeedOptions

# The longest timeout_s. torch's process groups and stores turn the timeout into a deadline on a 64-bit clock of
# nanoseconds, which overflows past 2**63 ns (9.2e9 s, 292 years); measured with gloo (torch 2.13): 4e9 s works,
# 9e9 s hangs at the start, 1e10 s fails to connect. A timedelta holds at most 8.6e13 s (1e15 raises). 1e9 s
# (about 31 years) stays well inside both.
MAX_TIMEOUT_S = 1e9


@dataclass
class StrategyChoice(Settings):
    """Which strategy runs: a name of the registry (strategies/__init__.py), or auto."""

    # train and finetune show it as --multi-gpu (recipes/common.py); each verb takes both names.
    strategy: str = setting("auto", "how to spread training over processes", choices=STRATEGIES, aliases=("multi_gpu",))


# The fields come in the order of the groups from the last base to the first, then the Engine's own: so --help
# lists the strategy and the training step first and DeepSpeed's options after the others.
@dataclass
class EngineConfig(
    DeepSpeedOptions,
    CompressionOptions,
    DDPOptions,
    ShardingOptions,
    PipelineOptions,
    TensorParallelOptions,
    LayoutSettings,
    OptimizerSettings,
    ComputeSettings,
    TrainingSettings,
    StrategyChoice,
):
    """Every setting of the Engine: the groups it is made of, and those only the Engine reads."""

    sync_batchnorm: bool = setting(
        False,
        "convert BatchNorm to SyncBatchNorm, so every process normalises with the global batch's statistics "
        "(process-group strategies on GPUs; one process has nothing to synchronise)",
    )
    backend: str | None = setting(
        None,
        "process-group backend (default: nccl with a GPU per process; gloo on CPU, or where processes share GPUs)",
        choices=BACKENDS,
    )
    timeout_s: float = setting(1800.0, "seconds a collective may wait before the run fails")
    fault_tolerance: bool = setting(
        False,
        "train the data-parallel replica groups that --replica-groups starts under torchft: a group that dies costs "
        "the others one step run again, not a restart, and rejoins healed from a live one; every step's global batch "
        "is trained in full by the groups alive (pip install 'multigpu[ft]')",
    )
    log_every: int = setting(0, "report memory, throughput and MFU every N optimizer steps (0: never)")
    log_dir: str | None = setting(None, "also write those reports and engine.log's records as JSONL and to --log-to")
    peak_tflops: float | None = setting(
        None, "the device's dense peak TFLOPS for MFU (default: looked up by the GPU's exact name)"
    )
    log_to: str = setting(
        "tensorboard",
        "where the metrics go besides metrics.jsonl: a comma-separated subset of tensorboard, wandb, mlflow, jsonl "
        "(jsonl alone: metrics.jsonl only); wandb and mlflow need pip install 'multigpu[trackers]'",
    )
    run_name: str | None = setting(
        None, "the run's name in W&B and MLflow (default: the name of the folder the metrics go to)"
    )

    def check(self) -> None:
        # Strategy names are checked where strategies are built (build_strategy). Each range is written as what
        # passes, so that nan, for which every comparison is false, never does.
        require(
            (
                0 < self.timeout_s <= MAX_TIMEOUT_S,
                f"timeout_s must be a positive number of seconds up to {MAX_TIMEOUT_S:,.0f} (about 31 years), which "
                f"the process group's deadlines can hold (got {self.timeout_s:g}).",
            ),
            (self.log_every >= 0, f"log_every must be 0 or more (got {self.log_every})."),
            (
                self.peak_tflops is None or 0 < self.peak_tflops < math.inf,
                f"peak_tflops must be a positive finite number (got {self.peak_tflops}).",
            ),
        )
        parse_log_to(self.log_to, self.log_dir)
        # Settings that cannot go together, and features the strategy does not run with: the one table of them.
        check_settings(self)

    @classmethod
    def of(cls, strategy: str, settings: dict[str, Any]) -> EngineConfig:
        """The config of `Engine(strategy, **settings)`, or one sentence naming the settings it does not know."""
        names = [f.name for f in fields(cls) if f.name != "strategy"]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise UsageError(
                f"Engine got unknown setting(s) {', '.join(unknown)}; the settings are EngineConfig's fields: "
                f"{', '.join(names)}."
            )
        return cls(strategy=strategy, **settings)
