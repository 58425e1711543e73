"""The Engine's settings: one dataclass, which the CLI maps flag for flag (`multigpu demo`, bench, verify)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from multigpu.core.env import BACKENDS
from multigpu.core.errors import UsageError, require
from multigpu.core.precision import PRECISIONS, Precision
from multigpu.engine.trackers import parse_log_to
from multigpu.planner.layout import PP_SCHEDULES
from multigpu.strategies import STRATEGIES
from multigpu.strategies.deepspeed import DeepSpeedOptions

UNSHARDED_GRAD_ACCUM_HELP = (
    "zero2/zero3: accumulate whole gradients locally and reduce-scatter once per optimizer step (less "
    "communication, a full gradient per rank) instead of on every micro-step"
)
PEAK_TFLOPS_HELP = "the device's dense peak TFLOPS for MFU (default: looked up by the GPU's exact name)"
FIND_UNUSED_HELP = (
    "ddp/zero1: let some parameters get no gradient in a step (costs a pass over the autograd graph every step)"
)
REPLICATE_HELP = "hsdp: whole model replicas, each sharded over its processes (default: one per node)"
TP_SIZE_HELP = (
    "tensor parallel degree: each layer of the model's tp_plan split over this many processes, which read the "
    "same batch (strategy tp: every process; zero2, zero3, hsdp: inside their data parallelism)"
)
PP_SIZE_HELP = (
    "pipeline stages' processes: strategy pp over the rest as whole replicas, or zero2, zero3 or hsdp inside each "
    "stage (default for pp: every process outside tp)"
)
SEQUENCE_PARALLEL_HELP = (
    "with tp: also split a Hugging Face decoder's norms and residual stream by sequence position over the tp "
    "processes (less activation memory; the sequence length must be a multiple of tp_size)"
)
PP_SCHEDULE_HELP = "pp: gpipe (all forwards, then all backwards), 1f1b (less memory) or interleaved"
PP_STAGES_HELP = "pp with schedule interleaved: stages per process (2 or more; a smaller pipeline bubble)"
PP_MICROBATCHES_HELP = "pp: slices of each batch that flow through the pipeline (default: one per stage)"
LOG_TO_HELP = (
    "where the metrics go besides metrics.jsonl: a comma-separated subset of tensorboard, wandb, mlflow, jsonl "
    "(jsonl alone: metrics.jsonl only); wandb and mlflow need pip install 'multigpu[trackers]'"
)
RUN_NAME_HELP = "the run's name in W&B and MLflow (default: the name of the folder the metrics go to)"
# The longest timeout_s. torch's process groups and stores turn the timeout into a deadline on a 64-bit clock of
# nanoseconds, which overflows past 2**63 ns (9.2e9 s, 292 years); measured with gloo (torch 2.13): 4e9 s works,
# 9e9 s hangs at the start, 1e10 s fails to connect. A timedelta holds at most 8.6e13 s (1e15 raises). 1e9 s
# (about 31 years) stays well inside both.
MAX_TIMEOUT_S = 1e9
SYNC_BATCHNORM_HELP = (
    "convert BatchNorm to SyncBatchNorm, so every process normalises with the global batch's statistics "
    "(process-group strategies on GPUs; one process has nothing to synchronise)"
)


@dataclass
class EngineConfig(DeepSpeedOptions):
    strategy: str = field(
        default="auto", metadata={"help": "how to spread training over processes", "choices": STRATEGIES}
    )
    precision: str = field(default="32", metadata={"help": "number format for training", "choices": PRECISIONS})
    grad_accum_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_grad_norm: float | None = field(default=None, metadata={"help": "clip the global gradient norm to this"})
    seed: int = field(default=0, metadata={"help": "seed for model init and data order (the same on every rank)"})
    cpu_offload: bool = field(default=False, metadata={"help": "keep zero3's sharded parameters in CPU memory"})
    replicate: int | None = field(default=None, metadata={"help": REPLICATE_HELP})
    tp_size: int | None = field(default=None, metadata={"help": TP_SIZE_HELP})
    sequence_parallel: bool = field(default=False, metadata={"help": SEQUENCE_PARALLEL_HELP})
    pp_size: int | None = field(default=None, metadata={"help": PP_SIZE_HELP})
    pp_schedule: str = field(default="1f1b", metadata={"help": PP_SCHEDULE_HELP, "choices": PP_SCHEDULES})
    pp_stages_per_rank: int = field(default=1, metadata={"help": PP_STAGES_HELP})
    pp_microbatches: int | None = field(default=None, metadata={"help": PP_MICROBATCHES_HELP})
    unsharded_grad_accum: bool = field(default=False, metadata={"help": UNSHARDED_GRAD_ACCUM_HELP})
    find_unused_parameters: bool = field(default=False, metadata={"help": FIND_UNUSED_HELP})
    sync_batchnorm: bool = field(default=False, metadata={"help": SYNC_BATCHNORM_HELP})
    backend: str | None = field(
        default=None,
        metadata={"help": "process-group backend (default: nccl on GPUs, gloo on CPU)", "choices": BACKENDS},
    )
    timeout_s: float = field(default=1800.0, metadata={"help": "seconds a collective may wait before the run fails"})
    log_every: int = field(
        default=0, metadata={"help": "report memory, throughput and MFU every N optimizer steps (0: never)"}
    )
    log_dir: str | None = field(
        default=None, metadata={"help": "also write those reports and engine.log's records as JSONL and to --log-to"}
    )
    peak_tflops: float | None = field(default=None, metadata={"help": PEAK_TFLOPS_HELP})
    log_to: str = field(default="tensorboard", metadata={"help": LOG_TO_HELP})
    run_name: str | None = field(default=None, metadata={"help": RUN_NAME_HELP})

    def __post_init__(self) -> None:
        # Strategy names are checked where they are resolved (resolve_strategy), precisions by Precision. Each
        # range is written as what passes, so that nan, for which every comparison is false, never does.
        super().__post_init__()
        Precision(self.precision)
        require(
            (self.grad_accum_steps >= 1, f"grad_accum_steps must be 1 or more (got {self.grad_accum_steps})."),
            (
                self.max_grad_norm is None or 0 < self.max_grad_norm < math.inf,
                f"max_grad_norm must be a positive finite number (got {self.max_grad_norm}); leave it unset for none.",
            ),
            (
                0 <= self.seed < 2**32,
                f"seed must be from 0 to 2**32 - 1, the seeds numpy takes (got {self.seed}).",
            ),
            (
                self.replicate is None or self.replicate >= 1,
                f"replicate must be 1 or more (got {self.replicate}); leave it unset for one replica per node.",
            ),
            (
                self.tp_size is None or self.tp_size >= 1,
                f"tp_size must be 1 or more (got {self.tp_size}); leave it unset for none.",
            ),
            (
                self.pp_size is None or self.pp_size >= 1,
                f"pp_size must be 1 or more (got {self.pp_size}); leave it unset for none.",
            ),
            (
                self.pp_microbatches is None or self.pp_microbatches >= 1,
                f"pp_microbatches must be 1 or more (got {self.pp_microbatches}).",
            ),
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
