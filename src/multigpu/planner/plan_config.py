"""What `multigpu plan` is asked: the GPUs, the training set-up and the model-parallel layout, checked on entry."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from multigpu.config.layout import (
    LayoutSettings,
    ParallelDims,
    ShardingOptions,
    TensorParallelOptions,
    cp_chunks,
    resolve_layout,
)
from multigpu.config.optimizer import OPTIMIZERS, OptimizerSettings  # noqa: F401  (importers)
from multigpu.config.pipeline import ZERO_BUBBLE, PipelineOptions, check_microbatches, check_schedule
from multigpu.config.settings import ComputeSettings, Settings, TrainingSettings, setting, shown
from multigpu.core.errors import UsageError
from multigpu.planner.gpus import GpuKind, node_gpus
from multigpu.planner.rows import reference
from multigpu.planner.rows import row as row_of


def takes_cp(row: str) -> bool:
    """Whether a row's strategy splits sequences over cp ranks (single, dp, tp and DeepSpeed's do not)."""
    return "cp" in row_of(row).spread.takes


def takes_ep(row: str) -> bool:
    """Whether a row's strategy spreads a mixture's experts over ep ranks (single, dp, tp and DeepSpeed's do not)."""
    return "ep" in row_of(row).spread.takes


@dataclass
class PlanConfig(Settings):
    """What `multigpu plan` is asked. The training set-up and layout are the Engine's settings, each keeping its one
    definition (config/settings.py: shown), planned for a GPU cluster: bf16-mixed and no model parallelism unless
    asked."""

    precision: str = shown(TrainingSettings, default="bf16-mixed")
    grad_accum_steps: int = shown(TrainingSettings, note=" (plan: changes memory only with --unsharded-grad-accum)")
    cpu_offload: bool = shown(ShardingOptions, note=" (plan: allows the zero3+offload row to be recommended)")
    unsharded_grad_accum: bool = shown(ShardingOptions)
    tp_size: int | None = shown(LayoutSettings, default=1)
    pp_size: int | None = shown(LayoutSettings, default=1)
    cp_size: int | None = shown(
        LayoutSettings, default=1, note="; plan: also shows the longest sequence each row fits at batch size 1"
    )
    ep_size: int | None = shown(
        LayoutSettings,
        note="; plan: unset, a mixture's rows take ep 1, zero3 is shown at every ep that divides its processes and "
        "the experts, and the recommendation takes the smallest ep its strategy fits at",
    )
    cp_method: str = shown(LayoutSettings)
    sequence_parallel: bool = shown(TensorParallelOptions)
    pp_schedule: str = shown(PipelineOptions)
    pp_stages_per_rank: int = shown(PipelineOptions)
    pp_split: str | None = shown(PipelineOptions, note="; plan: the pipeline rank shown is the one whose total binds")
    microbatches: int | None = shown(PipelineOptions, "pp_microbatches")
    activation_checkpointing: str = shown(ComputeSettings, note=" (plan: offload counts what stays on the GPU)")
    # The cluster and the model's training, plan's own.
    gpus: str = setting(
        "1",
        "GPUs per node: a count, of --gpu-memory each; or a node of different GPUs, one by one or as COUNTxGPU "
        "groups, a GPU being its memory or NAME-MEMORY (4xH100-80GB,4xA100-40GB; 4x80GB,4x40GB): the table is for "
        "the smallest, and the batch shares each GPU's memory holds follow it",
    )
    nodes: int = setting(1, "machines")
    gpu_memory: str = setting("80GB", "memory of one GPU, e.g. 80GB or 24GiB")
    optimizer: str = shown(OptimizerSettings, note=" (the planner counts its states)")
    batch_size: int = setting(8, "sequences per GPU per micro-batch")
    seq_len: int = setting(2048, "tokens per sequence")
    lora_r: int | None = setting(None, "LoRA rank: train adapters on every projection")
    qlora: bool = setting(False, "4-bit (nf4) frozen base under LoRA adapters")

    def check(self) -> None:
        self.gpus = str(self.gpus)  # a count given as a number, from Python or a config file
        if self.mixed and self.gpu_memory != PlanConfig.gpu_memory:
            raise UsageError(f"--gpus {self.gpus} gives each GPU's memory; drop --gpu-memory {self.gpu_memory}.")
        for name in ("nodes", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be 1 or more (got {getattr(self, name)}).")
        self.tp_size, self.pp_size, self.cp_size = self.tp_size or 1, self.pp_size or 1, self.cp_size or 1
        self.pp_stages_per_rank = check_schedule(self.pp_schedule, self.pp_stages_per_rank)  # zbv, dualpipev: 2
        if self.microbatches is None:
            # torchtitan's default: one micro-batch per stage (per rank, as it always was here, for the older ones)
            zero_bubble = self.pp_schedule in ZERO_BUBBLE
            self.microbatches = self.pp_size * (self.pp_stages_per_rank if zero_bubble else 1)
        if self.pp_size > 1:
            check_microbatches(self.pp_schedule, self.pp_size, self.pp_stages_per_rank, self.microbatches)
        if self.sequence_parallel and self.tp_size == 1:
            raise UsageError("--sequence-parallel splits the sequence over the tp GPUs; add --tp-size or drop it.")
        if self.world % (self.tp_size * self.pp_size * self.cp_size):
            cp = f" x --cp-size {self.cp_size}" if self.cp_size > 1 else ""
            raise UsageError(
                f"--tp-size {self.tp_size} x --pp-size {self.pp_size}{cp} does not divide the {self.world} GPUs "
                f"(--gpus x --nodes); choose degrees whose product divides {self.world}."
            )
        chunks = cp_chunks(self.cp_size)
        if self.seq_len % chunks:
            raise UsageError(
                f"--seq-len {self.seq_len} is not a multiple of 2 x --cp-size {self.cp_size} = {chunks} "
                f"(each cp rank holds a head and a tail chunk of every sequence); choose a multiple of {chunks}."
            )
        if self.lora_r is not None and self.lora_r < 1:
            raise UsageError(f"--lora-r must be 1 or more (got {self.lora_r}).")
        if self.qlora and self.lora_r is None:
            self.lora_r = 16  # QLoRA trains LoRA adapters on the quantised base; 16 is peft's usual rank

    @functools.cached_property
    def node_gpus(self) -> list[GpuKind]:
        """Each GPU of a node (refuses what cannot be one, before anything is planned); read once, as the plan asks
        it for the world size and the smallest memory at every row."""
        return node_gpus(self.gpus, self.gpu_memory)

    @property
    def mixed(self) -> bool:
        """Whether a node's GPUs differ in memory or speed."""
        return len(set(self.node_gpus)) > 1

    @property
    def gpu_bytes(self) -> float:
        """The memory every GPU has: the smallest one's."""
        return min(gpu.memory for gpu in self.node_gpus)

    @property
    def world(self) -> int:
        return len(self.node_gpus) * self.nodes

    @property
    def model_parallel(self) -> bool:
        return self.tp_size * self.pp_size > 1

    def layout(self, row: str) -> ParallelDims:
        """The degrees of a row's strategy on this cluster, as that strategy would resolve them."""
        cp = self.cp_size if takes_cp(row) else None
        ep = self.ep_size if takes_ep(row) else None
        request = LayoutSettings(tp_size=self.tp_size, pp_size=self.pp_size, cp_size=cp, ep_size=ep)
        # Each row's degrees are resolved as its strategy's are when it runs (config/layout.py).
        return resolve_layout(request, row_of(row).spread, self.world, self.nodes, row)

    @property
    def data_parallel(self) -> int:
        """The ranks that train on different batches beside tp x pp, as the data-parallel strategies lay them out."""
        return self.layout(reference()).data_parallel_size
