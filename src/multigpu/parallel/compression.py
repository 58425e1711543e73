"""Compressed gradient communication (`grad_compression`): what each rank hands to the gradient collectives.

bf16 and fp16 halve an fp32 gradient's bytes: under ddp and zero1 through DDP's communication hooks (each bucket
cast, averaged, cast back), under zero2, zero3 and hsdp as the reduce dtype of FSDP2's MixedPrecisionPolicy.
powersgd sends each gradient matrix of n x m as two factors of rank r, r (n + m) numbers instead of n m, with torch's
PowerSGD hook (ddp and zero1 only: FSDP2 has no communication hooks). Its error feedback (what compression left out,
added to the next step's gradient) and its warm-started factors are state, saved per rank in checkpoints and keyed
by parameter names (powersgd.py), so that a resume computes what the uninterrupted run computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from multigpu.config.settings import StrategyOptions, setting
from multigpu.core.errors import UsageError

KINDS = ("none", "bf16", "fp16", "powersgd")
#: PowerSGD's rank when none is given: the PowerSGD paper's (Vogels et al., 2019) setting that matched uncompressed
#: SGD's accuracy on its image models, where rank 1 (torch's default) lost some; 2 still sends under 1% of a
#: 4096 x 4096 matrix.
POWERSGD_RANK = 2
#: Steps that all-reduce whole gradients before PowerSGD starts: 2, the fewest torch allows with error feedback,
#: because DDP regroups its buckets after the first step. A longer warm-up is a tuning choice (torch suggests 10% of
#: training); error feedback already makes the compressed steps add up to the true gradients over time.
POWERSGD_START = 2
#: A gradient matrix is compressed only when its factors are at most half its size (torch's min_compression_rate).
MIN_COMPRESSION_RATE = 2
_REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Compression:
    """A parsed grad_compression: its kind, and PowerSGD's rank (0 for the others)."""

    kind: str = "none"
    rank: int = 0

    @classmethod
    def parse(cls, value: str) -> Compression:
        """`none`, `bf16`, `fp16`, `powersgd` or `powersgd:RANK`; one sentence refuses anything else."""
        kind, colon, rank = value.partition(":")
        if kind == "powersgd":
            if not colon:
                return cls(kind, POWERSGD_RANK)
            if rank.isdigit() and int(rank) >= 1:
                return cls(kind, int(rank))
        elif kind in KINDS and not colon:
            return cls(kind)
        raise UsageError(
            f"Unknown grad_compression {value!r}; choose none, bf16, fp16, powersgd or powersgd:RANK with RANK a "
            f"positive whole number (powersgd alone: rank {POWERSGD_RANK})."
        )

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (bf16, fp16), or None: as they are."""
        return _REDUCE_DTYPES.get(self.kind)


@dataclass
class CompressionOptions(StrategyOptions):
    """How the strategies that reduce gradients (ddp, zero1, zero2, zero3, hsdp) compress them."""

    grad_compression: str = setting(
        "none",
        "what the gradient collectives send: none, the gradients as they are; bf16 or fp16, each gradient halved to "
        "16 bits (ddp, zero1, zero2, zero3, hsdp); powersgd[:RANK], each gradient matrix as two rank-RANK factors with "
        f"error feedback (ddp, zero1; RANK {POWERSGD_RANK} unless given)",
        metavar="{none,bf16,fp16,powersgd[:RANK]}",
    )

    def check(self) -> None:
        Compression.parse(self.grad_compression)

    @property
    def compression(self) -> Compression:
        return Compression.parse(self.grad_compression)


def refuse_powersgd(strategy: str, compression: str) -> None:
    """Refuses powersgd for a strategy that reduces gradients through FSDP2 (zero2, zero3, hsdp)."""
    if Compression.parse(compression).kind == "powersgd":
        raise UsageError(powersgd_refusal(strategy))


def powersgd_refusal(strategy: str) -> str:
    """The sentence refusing powersgd under `strategy` (strategies/compatibility.py's, and bench's and simulate's)."""
    return (
        f"grad_compression powersgd runs as a DDP communication hook and {strategy} reduces through FSDP2, which "
        "has none; use bf16 or fp16 with it, or powersgd with strategy ddp or zero1."
    )


def compressed(shape: tuple[int, ...], rank: int) -> int | None:
    """Elements PowerSGD sends for a gradient of `shape` (as torch's hook views it: rows x the rest), or None when
    the hook sends it whole (a vector, or factors bigger than half the matrix)."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = math.prod(shape) // n
    r = min(n, m, rank)
    return r * (n + m) if r * (n + m) * MIN_COMPRESSION_RATE < n * m else None


def payload_bytes(shapes: Iterable[tuple[int, ...]], compression: Compression, element_bytes: int) -> int:
    """Bytes one rank hands to the gradient collectives in a step, for gradients of `shapes` in `element_bytes`
    each: 2 per element with bf16 or fp16; with PowerSGD (once started), its factors for each matrix it compresses
    and every other gradient whole."""
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if compression.reduce_dtype is not None:
            total += numel * 2
        elif compression.kind == "powersgd":
            total += (compressed(tuple(shape), compression.rank) or numel) * element_bytes
        else:
            total += numel * element_bytes
    return total


def step_payload_bytes(model: torch.nn.Module, grad_compression: str, param_dtype: torch.dtype) -> int:
    """Bytes one rank hands to the gradient collectives in an optimizer step: the whole shapes of the parameters
    that train (a DTensor's shape is the whole tensor's: zero2 and zero3 reduce-scatter whole gradients), their
    gradients in `param_dtype`, compressed as `grad_compression` says."""
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return payload_bytes(shapes, Compression.parse(grad_compression), torch.empty((), dtype=param_dtype).element_size())


def wire_factor(collective: str, processes: int) -> float:
    """The share of a step's payload each rank sends in a ring over `processes` ranks under a strategy whose
    gradient `collective` (strategies/facts.py) is all_reduce, 2 (n - 1) / n (ddp, zero1), or reduce_scatter,
    (n - 1) / n (zero2, zero3)."""
    share = (processes - 1) / processes
    return 2 * share if collective == "all_reduce" else share
