"""GPUs as the planner and the monitor know them: memory sizes, each card's peak TFLOPS, a node's GPUs when they
differ (`--gpus 4xH100-80GB,4xA100-40GB`), and the batch shares that such a node's memory holds. Pure: no torch."""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

from multigpu.config.flags import parse_groups
from multigpu.config.layout import split_by_shares
from multigpu.core.errors import UsageError


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


class PeakTflops(NamedTuple):
    """One card's dense (no sparsity) peak TFLOPS; None where it has no tensor cores for the format."""

    fp16: float  # tensor cores, FP32 accumulation
    bf16: float | None
    tf32: float | None
    fp32: float  # plain FP32, without tensor cores


HOPPER_SXM = PeakTflops(fp16=989.4, bf16=989.4, tf32=494.7, fp32=66.9)
AMPERE_A100 = PeakTflops(fp16=312.0, bf16=312.0, tf32=156.0, fp32=19.5)
VOLTA_V100_SXM2 = PeakTflops(fp16=125.0, bf16=None, tf32=None, fp32=15.7)

# Keyed by the exact names torch.cuda.get_device_name() returns: a substring would lend "NVIDIA H100 NVL" the SXM
# card's figures, "NVIDIA A10G" the A10's and "NVIDIA L40" the L4's. Figures are NVIDIA's datasheets' (Hopper's
# and Ada's architecture whitepapers for their unrounded values and for the GeForce card); a card whose figures
# are not certain is left out, and MFU is then not reported rather than wrong.
PEAK_TFLOPS: dict[str, PeakTflops] = {
    "NVIDIA H100 80GB HBM3": HOPPER_SXM,
    "NVIDIA H200": HOPPER_SXM,  # the SXM card, the H100 SXM's compute; the H200 NVL is named "NVIDIA H200 NVL"
    "NVIDIA H100 PCIe": PeakTflops(fp16=756.0, bf16=756.0, tf32=378.0, fp32=51.2),
    "NVIDIA A100-SXM4-40GB": AMPERE_A100,
    "NVIDIA A100-SXM4-80GB": AMPERE_A100,
    "NVIDIA A100-PCIE-40GB": AMPERE_A100,
    "NVIDIA A100 80GB PCIe": AMPERE_A100,
    "NVIDIA L40S": PeakTflops(fp16=362.05, bf16=362.05, tf32=183.0, fp32=91.6),
    "NVIDIA L4": PeakTflops(fp16=121.0, bf16=121.0, tf32=60.0, fp32=30.3),
    "NVIDIA A10": PeakTflops(fp16=125.0, bf16=125.0, tf32=62.5, fp32=31.2),
    "Tesla V100-SXM2-16GB": VOLTA_V100_SXM2,
    "Tesla V100-SXM2-32GB": VOLTA_V100_SXM2,
    "Tesla T4": PeakTflops(fp16=65.0, bf16=None, tf32=None, fp32=8.1),
    "NVIDIA GeForce RTX 4090": PeakTflops(fp16=165.2, bf16=165.2, tf32=82.6, fp32=82.6),
}
# The short names `--gpus` takes (NAME-MEMORY), each the card of that name in the table above (the SXM one where
# there are several: an H100 PCIe is 24% slower).
SHORT_NAMES = {
    "H100": "NVIDIA H100 80GB HBM3",
    "H200": "NVIDIA H200",
    "A100": "NVIDIA A100-SXM4-80GB",
    "L40S": "NVIDIA L40S",
    "L4": "NVIDIA L4",
    "A10": "NVIDIA A10",
    "V100": "Tesla V100-SXM2-32GB",
    "T4": "Tesla T4",
    "RTX4090": "NVIDIA GeForce RTX 4090",
}


class GpuKind(NamedTuple):
    """One GPU of a node: its name as given (None for a bare memory size), memory, and fp16 peak (None: unknown)."""

    name: str | None
    memory: float
    tflops: float | None

    @property
    def label(self) -> str:
        return f"{self.name}-{self.memory / 2**30:g}GB" if self.name else f"{self.memory / 2**30:g}GB"


def gpu_kind(text: str) -> GpuKind:
    """'H100-80GB' (a name in SHORT_NAMES, then the card's memory) or '80GB' (the memory alone)."""
    name, _, memory = text.rpartition("-")
    if name and name.upper() not in SHORT_NAMES:
        raise UsageError(
            f"--gpus names a GPU {name!r} whose speed is not known; name one of {', '.join(SHORT_NAMES)}, or give "
            "its memory alone (4x80GB)."
        )
    tflops = PEAK_TFLOPS[SHORT_NAMES[name.upper()]].fp16 if name else None
    return GpuKind(name.upper() or None, parse_bytes(memory, "--gpus"), tflops)


def node_gpus(gpus: str | int, gpu_memory: str) -> list[GpuKind]:
    """A node's GPUs, one by one: a count of --gpu-memory each, or `--gpus` listing them (4xH100-80GB,4x40GB)."""
    if isinstance(gpus, int) or str(gpus).strip().isdigit():
        count = int(gpus)
        if count < 1:
            raise UsageError(f"--gpus must be 1 or more (got {count}).")
        return [GpuKind(None, parse_bytes(gpu_memory), None)] * count
    return parse_groups(str(gpus), "--gpus", gpu_kind, "8, or 4xH100-80GB,4xA100-40GB, or 4x80GB,4x40GB")


def shares_that_fit(most: list[int], speeds: list[float], total: int) -> list[int] | None:
    """Each GPU's slice of a global batch of `total`: in proportion to `speeds`, none above its `most` (what its
    memory holds), each at least 1, adding up to `total`; None where their memory cannot hold it. What a GPU's
    memory caps is handed to the others, still by speed (water-filling)."""
    if sum(most) < total or min(most) < 1 or total < len(most):
        return None
    slices, free, left = list(most), list(range(len(most))), total
    while True:
        weight = sum(speeds[i] for i in free)
        capped = [i for i in free if left * speeds[i] / weight >= most[i]]
        if not capped:
            break
        free = [i for i in free if i not in capped]
        left -= sum(most[i] for i in capped)
    # Below its cap, each free GPU's exact share is under its whole `most`, so rounding up keeps it within.
    for i, part in zip(free, split_by_shares(left, [speeds[i] for i in free]), strict=True):
        slices[i] = part
    return slices


def quickest_split(most: list[int], fixed: list[float], per_sample: list[float], total: int) -> list[int] | None:
    """Each rank's part of a global batch of `total` that makes the slowest rank's step, `fixed` plus `per_sample`
    times its part, the shortest: each at least 1, none above its `most`, adding up to `total`; None where their
    memory cannot hold it. A rank's fixed per-step work (its optimizer step, Python's launch of each op) runs
    whatever its part, so parts in proportion to speed alone leave the rank with the most of it the straggler.

    One sample at a time to the rank whose step it lengthens the least: for steps that grow with the part this
    reaches the smallest largest step (ties to the lower rank, so every rank computes the same split)."""
    if sum(most) < total or min(most) < 1 or total < len(most):
        return None
    parts = [1] * len(most)
    grown = [(fixed[rank] + 2 * per_sample[rank], rank) for rank in range(len(most)) if most[rank] > 1]
    heapq.heapify(grown)
    for _ in range(total - len(most)):
        _, rank = heapq.heappop(grown)
        parts[rank] += 1
        if parts[rank] < most[rank]:
            heapq.heappush(grown, (fixed[rank] + per_sample[rank] * (parts[rank] + 1), rank))
    return parts


@dataclass
class MixedGpus:
    """A node of different GPUs under the recommended strategy: the largest batch each GPU's memory holds, and each
    one's slice of the global batch (None where none fits; with tp, pp or cp, where each slice is a group's, the
    table's smallest GPU alone is planned)."""

    gpus: list[str]  # each GPU of the job, in rank order (node after node)
    most: list[int]  # the largest per-GPU batch each holds
    slices: list[int] | None
    global_batch: int
    by: str  # "speed" (every GPU's peak is known) or "memory" (slices in proportion to what each holds)
