"""What `multigpu plan` is asked: the GPUs, the training set-up and the model-parallel layout, checked on entry."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from multigpu.core.errors import UsageError
from multigpu.core.precision import PRECISIONS
from multigpu.planner.layout import PP_SCHEDULES, check_schedule

OPTIMIZERS = ("adamw", "sgd", "adamw8bit")


def parse_bytes(text: str | float, flag: str = "--gpu-memory") -> float:
    """'80GB', '80GiB', '24g', '1.5e10' -> bytes (GB here means GiB, as GPU spec sheets use it).

    A bare number is bytes; below 1 GiB it is refused, since no GPU is that small and `80` meant 80GB.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise UsageError(f"{flag} must be a size such as 80GB or 24GiB (got {text!r}).")
    match = re.fullmatch(r"\s*(.*?)\s*([kmgt](?:i?b)?|b)?\s*", str(text).lower(), flags=re.DOTALL)
    number, unit = match.group(1), match.group(2)
    try:
        value = float(number)
    except ValueError:
        raise UsageError(f"Cannot read the size {text!r}; write it like 80GB or 24GiB.") from None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{flag} must be positive and finite (got {text}); write it like 80GB or 24GiB.")
    if unit is None and value < 2**30:
        raise UsageError(
            f"{flag} {text} has no unit, so it would mean {number} bytes; write {number}GB or {number}GiB."
        )
    return value * 1024 ** "bkmgt".index((unit or "b")[0])


@dataclass
class PlanConfig:
    gpus: int = field(default=1, metadata={"help": "GPUs per node"})
    nodes: int = field(default=1, metadata={"help": "machines"})
    gpu_memory: str = field(default="80GB", metadata={"help": "memory of one GPU, e.g. 80GB or 24GiB"})
    precision: str = field(default="bf16-mixed", metadata={"help": "training precision", "choices": PRECISIONS})
    optimizer: str = field(default="adamw", metadata={"help": "optimizer states to count", "choices": OPTIMIZERS})
    batch_size: int = field(default=8, metadata={"help": "sequences per GPU per micro-batch"})
    seq_len: int = field(default=2048, metadata={"help": "tokens per sequence"})
    grad_accum_steps: int = field(
        default=1, metadata={"help": "micro-batches per step (memory only with --unsharded-grad-accum)"}
    )
    unsharded_grad_accum: bool = field(
        default=False,
        metadata={"help": "zero2/zero3 accumulate whole gradients between reduce-scatters (as the Engine option)"},
    )
    activation_checkpointing: bool = field(default=False, metadata={"help": "keep layer inputs only, recompute"})
    lora_r: int | None = field(default=None, metadata={"help": "LoRA rank: train adapters on every projection"})
    qlora: bool = field(default=False, metadata={"help": "4-bit (nf4) frozen base under LoRA adapters"})
    cpu_offload: bool = field(default=False, metadata={"help": "allow zero3 with parameters offloaded to CPU"})
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel degree: each layer split over this many GPUs"})
    sequence_parallel: bool = field(
        default=False, metadata={"help": "with --tp-size: norms and the residual stream split by position too"}
    )
    pp_size: int = field(default=1, metadata={"help": "pipeline-parallel degree: the layers split into this many"})
    pp_schedule: str = field(
        default="1f1b", metadata={"help": "pipeline schedule (the micro-batches in flight)", "choices": PP_SCHEDULES}
    )
    pp_stages_per_rank: int = field(default=1, metadata={"help": "with --pp-schedule interleaved: stages per GPU"})
    microbatches: int | None = field(
        default=None, metadata={"help": "pipeline micro-batches per step, each --batch-size (default: --pp-size)"}
    )

    def __post_init__(self) -> None:
        for name in ("gpus", "nodes", "batch_size", "seq_len", "grad_accum_steps", "tp_size", "pp_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be 1 or more (got {getattr(self, name)}).")
        self._check_layout()
        parse_bytes(self.gpu_memory)  # refuses what cannot be a GPU's memory, before anything is planned
        if self.precision not in PRECISIONS:
            raise UsageError(f"Unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}.")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"Unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}.")
        if self.lora_r is not None and self.lora_r < 1:
            raise UsageError(f"--lora-r must be 1 or more (got {self.lora_r}).")
        if self.qlora and self.lora_r is None:
            self.lora_r = 16  # QLoRA trains LoRA adapters on the quantised base; 16 is peft's usual rank

    def _check_layout(self) -> None:
        check_schedule(self.pp_schedule, self.pp_stages_per_rank)
        if self.microbatches is None:
            self.microbatches = self.pp_size  # torchtitan's default: one micro-batch per stage
        if self.microbatches < 1:
            raise UsageError(f"--microbatches must be 1 or more (got {self.microbatches}).")
        if self.sequence_parallel and self.tp_size == 1:
            raise UsageError("--sequence-parallel splits the sequence over the tp GPUs; add --tp-size or drop it.")
        if self.world % (self.tp_size * self.pp_size):
            raise UsageError(
                f"--tp-size {self.tp_size} x --pp-size {self.pp_size} does not divide the {self.world} GPUs "
                f"(--gpus x --nodes); choose degrees whose product divides {self.world}."
            )

    @property
    def gpu_bytes(self) -> float:
        return parse_bytes(self.gpu_memory)

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def model_parallel(self) -> bool:
        return self.tp_size * self.pp_size > 1

    @property
    def data_parallel(self) -> int:
        """The ranks that train on different batches: the world over tp x pp."""
        return self.world // (self.tp_size * self.pp_size)

    @property
    def hsdp_shard(self) -> int:
        """hsdp's shard degree beside tp: the data-parallel ranks of one node (tp takes the rest of it)."""
        return math.gcd(self.data_parallel, max(1, self.gpus // self.tp_size))
