"""batch_shares auto: each data-parallel rank's part of the global batch moved toward its speed as the run goes.

Each rank measures what its batches cost it, not the time it waits for the others in collectives
(multigpu.core.compute_clock): on a CPU, its main thread's demand for a CPU from the batch handed out to the end of
its backward, per sample; on a GPU, a fixed matrix product timed at each check, a cost per unit of work that the
ranks compare.

Every CHECK_EVERY optimizer steps (after WARMUP_STEPS, which pay for lazy initialisation and compilation) the ranks
all-gather their cost per sample and the largest batch their memory holds; every rank then computes the same
split (multigpu.planner.gpus.shares_that_fit: in proportion to speed, none above what its memory holds) and takes
it where it predicts a step at least HYSTERESIS shorter, or where a rank's part no longer fits: noise does not
shuffle the split. A split applies from the loader's next batch not yet planned, the same batch on every rank;
each step still trains on the same global batch, weighted as for fixed shares, so the run stays exact.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from multigpu.config.layout import ParallelDims
from multigpu.core.compute_clock import check_measurable, cpu_demand_s, probe_s, probe_tflop
from multigpu.core.env import collective_device
from multigpu.core.errors import UsageError
from multigpu.planner.gpus import shares_that_fit

WARMUP_STEPS = 2  # lazy initialisation, compilation and the FLOP count's step: not what later steps cost
CHECK_EVERY = 4  # optimizer steps measured per check: the average over them smooths a step's noise
HYSTERESIS = 0.05  # a new split must predict a step this much shorter
SMOOTHING = 0.5  # each check's weight in the costs' running average: a rank's cost per sample barely depends on
# its part, so checks under different splits average alike, and one noisy check moves the split by half as much
MEMORY_MARGIN = 0.9  # of the free memory a larger part may fill


def step_time(parts: list[int], costs: list[float]) -> float:
    """A step's predicted compute time: its slowest rank's part times that rank's cost per sample."""
    return max(part * cost for part, cost in zip(parts, costs, strict=True))


def next_split(parts: list[int], costs: list[float], most: list[float]) -> list[int] | None:
    """The split of a global batch of sum(parts) that the measured `costs` (seconds per sample) and `most` (the
    samples each rank's memory holds) call for, or None to keep `parts`."""
    total = sum(parts)
    caps = [int(min(cap, total - len(parts) + 1)) for cap in most]
    target = shares_that_fit(caps, [1 / cost for cost in costs], total)
    if target is None or target == parts:
        return None
    overfull = any(part > cap for part, cap in zip(parts, caps, strict=True))
    if overfull or step_time(parts, costs) > (1 + HYSTERESIS) * step_time(target, costs):
        return target
    return None


class Balancer:
    """One rank's measurements, and the split every rank computes from all of them."""

    def __init__(
        self, layout: ParallelDims, rank: int, world_size: int, device: torch.device, say: Callable[[str], None]
    ) -> None:
        check_measurable(device.type, "batch_shares")
        self.layout, self.rank, self.world_size, self.device, self.say = layout, rank, world_size, device, say
        self.parts: list[int] | None = None  # the split of a global micro-batch, once a check has seen the loader
        # Each data-parallel rank's measured speed: samples/s of compute (CPU) or the probe's TFLOP/s (GPU).
        self.speeds: list[float] | None = None
        self.speed_unit = "probe_tflops" if device.type == "cuda" else "samples_per_s"
        self.changes = 0
        self._costs: list[float] | None = None  # each data-parallel rank's cost per sample, averaged over checks
        self._demand, self._samples, self._started = 0.0, 0, None  # since the last check
        self._largest = 0  # this rank's largest micro-batch since the last check
        self._steps = 0
        self._even_s: list[float] = []  # timed steps' wall times before the first change
        self._settled_s: list[float] = []  # and since the last one
        self._reported = False

    @property
    def fractions(self) -> tuple[float, ...] | None:
        """Each data-parallel rank's fraction of a global batch, once known."""
        return None if self.parts is None else tuple(part / sum(self.parts) for part in self.parts)

    def start_batch(self) -> None:
        if self.device.type != "cuda":
            self._started = cpu_demand_s()

    def end_backward(self, samples: int) -> None:
        self._samples += samples
        self._largest = max(self._largest, samples)
        if self._started is not None:
            self._demand += cpu_demand_s() - self._started
            self._started = None

    def end_step(self, seconds: float, timed: bool, loader: Any) -> None:
        """After an optimizer step: every CHECK_EVERY steps, the split every rank computes, given to `loader`."""
        self._steps += 1
        if timed and self._steps > WARMUP_STEPS:
            (self._settled_s if self.changes else self._even_s).append(seconds)
        if self._steps <= WARMUP_STEPS or (self._steps - WARMUP_STEPS) % CHECK_EVERY:
            if self._steps <= WARMUP_STEPS:
                self._demand, self._samples = 0.0, 0
            return
        if loader is None:
            raise UsageError(
                "batch_shares auto moves the split of engine.dataloader's global batches, and this script's batches "
                "come from elsewhere; load them with engine.dataloader, or drop batch_shares."
            )
        if self.parts is None:
            self.parts = [loader.batch_size] * loader.world_size
        measured, most = self._gather()
        costs = self._costs = [
            cost if before is None else SMOOTHING * cost + (1 - SMOOTHING) * before
            for cost, before in zip(measured, self._costs or [None] * len(measured), strict=True)
        ]
        work = 1 if self.device.type != "cuda" else probe_tflop("cuda")  # a sample, or the probe's TFLOP
        self.speeds = [work / cost for cost in costs]
        self._demand, self._samples, self._largest = 0.0, 0, 0
        split = next_split(self.parts, costs, most)
        if split is not None:
            self.parts, self.changes, self._settled_s = split, self.changes + 1, []
            loader.set_shares(tuple(float(part) for part in split))
            speeds = ", ".join(f"{speed:.3g}" for speed in self.speeds)
            parts = ":".join(map(str, split))
            self.say(f"batch_shares auto: split {parts} from step {self._steps + 1} ({self.speed_unit} {speeds})")

    def _gather(self) -> tuple[list[float], list[float]]:
        """Each data-parallel rank's cost per sample (its slowest member's: the tp, cp and pp ranks of a group
        wait for each other) and the samples its memory holds (its fullest member's)."""
        cost = probe_s(self.device) if self.device.type == "cuda" else self._demand / max(self._samples, 1)
        on = collective_device(self.device)
        rows = [torch.empty(2, dtype=torch.float64, device=on) for _ in range(self.world_size)]
        dist.all_gather(rows, torch.tensor([cost, self._most()], dtype=torch.float64, device=on))
        costs = [0.0] * self.layout.data_parallel_size
        most = [math.inf] * self.layout.data_parallel_size
        for rank, row in enumerate(rows):
            group = self.layout.data_parallel_rank(rank)
            cost_r, most_r = row.tolist()
            costs[group], most[group] = max(costs[group], cost_r), min(most[group], most_r)
        return costs, most

    def _most(self) -> float:
        """The samples per micro-batch this rank's memory holds: on a GPU, its largest micro-batch so far plus what
        the free memory holds at that batch's cost per sample (everything above the memory held between steps
        counted as the batch's: an overestimate, so a safe cap); a CPU's memory is the host's, not the rank's."""
        if self.device.type != "cuda" or not self._largest:
            return math.inf
        peak, resting = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        free = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device) - peak
        per_sample = max(peak - resting, 1) / self._largest
        return self._largest + MEMORY_MARGIN * max(free, 0) / per_sample

    def summary(self) -> str | None:
        """What the run settled on and the step time it saved against the even split, measured; once."""
        if self._reported or self.parts is None:
            return None
        self._reported = True
        parts = ":".join(map(str, self.parts))
        if not self.changes:
            return (
                f"batch_shares auto kept the even split {parts}: the data-parallel ranks' measured speeds differ by "
                f"less than the {HYSTERESIS:.0%} a new split must gain"
            )
        line = f"batch_shares auto settled on {parts} of each global batch of {sum(self.parts)} ({self.changes} change"
        line += f"{'s' if self.changes > 1 else ''})"
        if self._even_s and self._settled_s:
            even, settled = statistics.median(self._even_s), statistics.median(self._settled_s)
            line += f"; a step takes {settled * 1e3:.1f} ms against {even * 1e3:.1f} ms at even shares "
            line += f"({even / settled:.2f}x, medians measured)"
        return line
