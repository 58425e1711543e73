"""batch_shares auto: each data-parallel rank's part of the global batch moved to where the measured steps say the
slowest rank's step is shortest, and kept there until a rank's speed changes.

A rank's step time grows with its part, but not in proportion: its optimizer step, the step's bookkeeping and
Python's launch of each op cost the same whatever the part, and a slow rank pays them slowly too. Parts in
proportion to each rank's cost per sample leave the slowest rank's fixed work the straggler (the sensor trainer
settled at 45:19 where 48:16 is faster). So each rank measures its whole step (multigpu.core.compute_clock: on a
CPU, its threads' demand for a CPU from one step's end to the next, which leaves out the waits in collectives;
on a GPU, whose kernels queue behind the collectives', a fixed matrix product timed at each check, a cost per sample
in proportion to the part), and StepTimes fits, from the steps at every part the rank has run, its step as fixed
seconds plus seconds per sample. Every CHECK_EVERY optimizer steps (after WARMUP_STEPS, which pay for lazy
initialisation and compilation) the ranks all-gather their steps and the largest batch their memory holds, and
every rank computes the same split (multigpu.planner.gpus.quickest_split: the smallest largest step, none above
what its memory holds).

It settles: a split is taken only where it predicts a step at least HYSTERESIS shorter, and more where the steps
measured at the current parts are noisy (SURE standard errors of their mean, from the checks' spread where a load
that comes and goes makes steps in a row alike); a move that turns back doubles that margin. With a single part
measured, the fit is in proportion to the part; a slope from a few noisy steps is pulled toward that (PRIOR) and
kept to at least LEAST_PER_SAMPLE of it: such errors under-shift, and the next check moves on, where a slope made
small by noise would over-shift and turn back. It follows a real change: steps SHIFT (or, where noisier, SURE_SHIFT
standard errors) slower or faster than the same rank's earlier steps at that part (or than any slope allows from its
nearest part) say its speed changed; its earlier steps are rescaled by what the steps since measure, and the margin
is reset. A split applies from the loader's next batch not yet planned, the same batch on every rank; each step
still trains on the same global batch, weighted as for fixed shares, so the run stays exact.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from multigpu.config.layout import ParallelDims
from multigpu.core.compute_clock import check_measurable, probe_s, probe_tflop, process_demand_s
from multigpu.core.env import collective_device
from multigpu.core.errors import UsageError
from multigpu.planner.gpus import quickest_split

WARMUP_STEPS = 2  # lazy initialisation, compilation and the FLOP count's step: not what later steps cost
CHECK_EVERY = 4  # optimizer steps between checks
HYSTERESIS = 0.05  # a new split must predict a step this much shorter (doubled by each move that turns back)
SURE = 2.5  # and this many standard errors of the mean step measured at the current parts
MIN_STEPS = 4  # steps at a part before their mean counts: no decision until every rank's current part has them
PRIOR = 1.0  # how far (a fraction of it) a rank's seconds per sample may stray from its step over its part, as
# believed before steps at different parts measure the slope
LEAST_PER_SAMPLE = 0.5  # of a step's seconds at its part, the least the fit lets grow with the part
SHIFT = 0.1  # a rank's steps this much slower or faster than before: its speed changed
SURE_SHIFT = 4.0  # and this many standard errors of that ratio's running average, where steps are noisier
NOISE = 0.1  # a step's relative spread about its part's mean, until the steps measure it
MEMORY_MARGIN = 0.9  # of the free memory a larger part may fill

Steps = Sequence[tuple[float, float]]  # one rank's steps: (its part of each micro-batch, seconds)


def step_time(parts: list[int], fixed: list[float], per_sample: list[float]) -> float:
    """A step's predicted time: its slowest rank's fixed seconds plus its part times its seconds per sample."""
    return max(f + b * part for part, f, b in zip(parts, fixed, per_sample, strict=True))


def next_split(
    parts: list[int], fixed: list[float], per_sample: list[float], most: list[float], margin: float = HYSTERESIS
) -> list[int] | None:
    """The split of a global batch of sum(parts) that the ranks' steps (`fixed` seconds plus `per_sample` seconds
    times the part) and `most` (the samples each rank's memory holds) call for, or None to keep `parts`: kept
    unless the new one predicts a step `margin` shorter, or a part no longer fits."""
    total = sum(parts)
    caps = [int(min(cap, total - len(parts) + 1)) for cap in most]
    target = quickest_split(caps, fixed, per_sample, total)
    if target is None or target == parts:
        return None
    overfull = any(part > cap for part, cap in zip(parts, caps, strict=True))
    if overfull or step_time(parts, fixed, per_sample) > (1 + margin) * step_time(target, fixed, per_sample):
        return target
    return None


@dataclass
class Part:
    """A rank's steps at one part: how many, their seconds summed and squared; and the same of the checks' means."""

    steps: float = 0.0
    seconds: float = 0.0
    squares: float = 0.0
    checks: float = 0.0
    means: float = 0.0
    mean_squares: float = 0.0

    @property
    def mean(self) -> float:
        return self.seconds / self.steps

    def add(self, seconds: list[float]) -> None:
        """One check's steps at this part."""
        mean = sum(seconds) / len(seconds)
        self.steps, self.seconds = self.steps + len(seconds), self.seconds + sum(seconds)
        self.squares += sum(one * one for one in seconds)
        self.checks, self.means, self.mean_squares = self.checks + 1, self.means + mean, self.mean_squares + mean * mean

    def scale(self, factor: float) -> None:
        self.seconds, self.squares = self.seconds * factor, self.squares * factor * factor
        self.means, self.mean_squares = self.means * factor, self.mean_squares * factor * factor


def pooled_spread(sums: list[tuple[float, float, float]]) -> float | None:
    """The relative standard deviation about their means of groups given as (count, sum, sum of squares), pooled;
    None with under 2 degrees of freedom."""
    spread, free = 0.0, 0.0
    for count, total, squares in sums:
        if count > 1 and total > 0:
            spread += max(squares - total * total / count, 0.0) / (total / count) ** 2
            free += count - 1
    return math.sqrt(spread / free) if free >= 2 else None


class StepTimes:
    """One data-parallel rank's measured steps, by its part."""

    def __init__(self) -> None:
        self.at: dict[float, Part] = {}
        self.before: dict[float, Part] | None = None  # the steps before its speed changed, until rescaled

    def add(self, steps: Steps) -> None:
        """One check's steps."""
        for part in sorted({part for part, _ in steps}):
            self.at.setdefault(part, Part()).add([seconds for at, seconds in steps if at == part])

    def steps(self, part: float) -> int:
        return int(self.at[part].steps) if part in self.at else 0

    def noise(self) -> float:
        """A step's relative standard deviation about its part's mean, pooled over the parts; or where larger, the
        checks' means' times the root of a check's steps: a machine's load that drifts over a few checks makes
        steps in a row alike, and their mean less sure than their spread says."""
        step = pooled_spread([(part.steps, part.seconds, part.squares) for part in self.at.values()])
        check = pooled_spread([(part.checks, part.means, part.mean_squares) for part in self.at.values()])
        return max(NOISE if step is None else step, 0.0 if check is None else check * math.sqrt(CHECK_EVERY))

    def line(self) -> tuple[float, float]:
        """Fixed seconds per step and seconds per sample of the part: the least-squares line through the steps,
        its slope pulled toward the step's time over its part where the parts measured are few or close (the
        prior's weight, noise over PRIOR, in the units of the parts' spread), kept to what a step can be."""
        n = sum(sums.steps for sums in self.at.values())
        x = sum(part * sums.steps for part, sums in self.at.items()) / n
        y = sum(sums.seconds for sums in self.at.values()) / n
        sxx = sum(sums.steps * (part - x) ** 2 for part, sums in self.at.items())
        sxy = sum((part - x) * (sums.seconds - sums.steps * y) for part, sums in self.at.items())
        proportional, prior = y / x, (self.noise() / PRIOR * x) ** 2
        slope = (sxy + prior * proportional) / (sxx + prior) if sxx + prior > 0 else proportional
        slope = min(max(slope, LEAST_PER_SAMPLE * proportional), proportional)
        return y - slope * x, slope

    def expected(self, part: float, seconds: float) -> tuple[float, int] | None:
        """What a step at `part` takes at the speed measured so far, the nearest to `seconds`, and how many steps
        say so: their mean at that part, or where it has too few, what any slope the fit allows gives from the
        nearest part that has enough. None before any part has."""
        known = [(abs(other - part), other) for other, sums in self.at.items() if sums.steps >= MIN_STEPS]
        if not known:
            return None
        other = min(known)[1]
        mean = self.at[other].mean
        ends = [mean + share * mean / other * (part - other) for share in (LEAST_PER_SAMPLE, 1.0)]
        return min(max(seconds, min(ends)), max(ends)), int(self.at[other].steps)

    def restart(self) -> None:
        """Its speed changed: the steps from here on measure it anew."""
        self.before, self.at = self.at, {}

    def rebase(self) -> bool:
        """Whether its steps are known at its present speed: once those since it changed number MIN_STEPS at a
        part, the steps before are rescaled to them (the fit's shape kept) and rejoin them."""
        if self.before is None:
            return True
        part = max(self.at, key=lambda part: self.at[part].steps, default=None)
        if part is None or self.at[part].steps < MIN_STEPS:
            return False
        fresh, self.at = self.at, self.before
        fixed, slope = self.line()
        for sums in self.at.values():
            sums.scale(fresh[part].mean / (fixed + slope * part))
        self.at.update(fresh)
        self.before = None
        return True


class SplitSearch:
    """The split every rank computes from every rank's steps, check after check: the same numbers in, the same
    split out."""

    def __init__(self, ranks: int) -> None:
        self.times = [StepTimes() for _ in range(ranks)]
        self.changes = 0
        self._margin = HYSTERESIS
        self._drift = [0.0] * ranks  # each rank's running average of log(its steps over what they took before)
        self._move: list[int] | None = None  # the last move, since a speed last changed

    def check(self, parts: list[int], windows: list[Steps], most: list[float]) -> list[int] | None:
        """The ranks' steps since the last check (`windows`, each rank's at `parts` or the parts before them): the
        new split, or None to keep `parts`."""
        changed = self._changed(windows)
        if any(changed):
            self._margin, self._move = HYSTERESIS, None
        for times, window, restarted in zip(self.times, windows, changed, strict=True):
            if restarted:  # the window holds steps at the old speed and the new: neither's
                times.restart()
            else:
                times.add(window)
        if not all([times.rebase() for times in self.times]):
            return None
        steps = min(times.steps(part) for times, part in zip(self.times, parts, strict=True))
        if steps < MIN_STEPS:
            return None
        noise = max(times.noise() for times in self.times)
        fixed, per_sample = zip(*(times.line() for times in self.times), strict=True)
        margin = max(self._margin, SURE * noise / math.sqrt(steps) * self._margin / HYSTERESIS)
        split = next_split(parts, list(fixed), list(per_sample), most, margin)
        if split is not None:
            self._moved([new - old for new, old in zip(split, parts, strict=True)])
        return split

    def _moved(self, move: list[int]) -> None:
        if self._move is not None and sum(a * b for a, b in zip(move, self._move, strict=True)) < 0:
            self._margin *= 2  # it turned back: noise, not speed, moved it
        self._move, self.changes = move, self.changes + 1

    def _changed(self, windows: list[Steps]) -> list[bool]:
        """Which ranks' speed changed: their steps' ratio to what the same parts took before, averaged over the
        checks, beyond SHIFT and SURE_SHIFT standard errors."""
        changed = [False] * len(windows)
        for rank, (times, window) in enumerate(zip(self.times, windows, strict=True)):
            known = [(seconds, guess) for part, seconds in window if (guess := times.expected(part, seconds))]
            if times.before is not None or not known:
                continue
            ratio = sum(seconds for seconds, _ in known) / sum(guess[0] for _, guess in known)
            self._drift[rank] = (self._drift[rank] + math.log(ratio)) / 2
            # A window's log-ratio varies as noise^2 (1/its steps + 1/the earlier steps'); halving, a third of it.
            sd = times.noise() * math.sqrt((1 / len(known) + 1 / min(guess[1] for _, guess in known)) / 3)
            if abs(self._drift[rank]) > max(SHIFT, SURE_SHIFT * sd):
                self._drift[rank], changed[rank] = 0.0, True
        return changed


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
        self._search = SplitSearch(layout.data_parallel_size)
        self._window: list[tuple[float, float, int]] = []  # timed steps since the last check: part, seconds, samples
        self._samples, self._micro, self._largest = 0, 0, 0  # this step's samples and micro-batches; largest since
        self._demand = process_demand_s() if device.type != "cuda" else 0.0  # at the last step's end
        self._steps = 0
        self._even_s: list[float] = []  # timed steps' wall times before the first change
        self._settled_s: list[float] = []  # and since the last one
        self._reported = False

    @property
    def changes(self) -> int:
        return self._search.changes

    @property
    def fractions(self) -> tuple[float, ...] | None:
        """Each data-parallel rank's fraction of a global batch, once known."""
        return None if self.parts is None else tuple(part / sum(self.parts) for part in self.parts)

    def end_backward(self, samples: int) -> None:
        self._samples, self._micro = self._samples + samples, self._micro + 1
        self._largest = max(self._largest, samples)

    def end_step(self, seconds: float, timed: bool, loader: Any) -> None:
        """After an optimizer step: every CHECK_EVERY steps, the split every rank computes, given to `loader`."""
        self._steps += 1
        demand, self._demand = self._demand, process_demand_s() if self.device.type != "cuda" else 0.0
        if timed and self._steps > WARMUP_STEPS and self._micro:
            (self._settled_s if self.changes else self._even_s).append(seconds)
            self._window.append((self._samples / self._micro, self._demand - demand, self._samples))
        self._samples, self._micro = 0, 0
        if self._steps > WARMUP_STEPS and not (self._steps - WARMUP_STEPS) % CHECK_EVERY:
            self._check(loader)

    def _check(self, loader: Any) -> None:
        if loader is None:
            raise UsageError(
                "batch_shares auto moves the split of engine.dataloader's global batches, and this script's batches "
                "come from elsewhere; load them with engine.dataloader, or drop batch_shares."
            )
        if self.parts is None:
            self.parts = [loader.batch_size] * loader.world_size
        windows, self.speeds, most = self._gather()
        self._window, self._largest = [], 0
        split = self._search.check(self.parts, windows, most)
        if split is not None:
            self.parts, self._settled_s = split, []
            loader.set_shares(tuple(float(part) for part in split))
            speeds = ", ".join(f"{speed:.3g}" for speed in self.speeds)
            parts = ":".join(map(str, split))
            self.say(f"batch_shares auto: split {parts} from step {self._steps + 1} ({self.speed_unit} {speeds})")

    def _row(self) -> list[float]:
        """This rank's steps since the last check (a part of 0 where none), its speed and the samples it holds."""
        steps = list(self._window[-CHECK_EVERY:])
        if self.device.type == "cuda":
            cost = probe_s(self.device)  # the seconds a sample takes, in the probe's units
            steps, speed = [(part, cost * part, n) for part, _, n in steps], probe_tflop("cuda") / cost
        else:
            speed = sum(n for _, _, n in steps) / max(sum(seconds for _, seconds, _ in steps), 1e-9)
        steps += [(0.0, 0.0, 0)] * (CHECK_EVERY - len(steps))
        return [part for part, _, _ in steps] + [seconds for _, seconds, _ in steps] + [speed, self._most()]

    def _gather(self) -> tuple[list[Steps], list[float], list[float]]:
        """Each data-parallel rank's steps (its slowest member's: the tp, cp and pp ranks of a group wait for each
        other), its speed (the slowest member's) and the samples its memory holds (its fullest member's)."""
        on = collective_device(self.device)
        size = 2 * CHECK_EVERY + 2
        rows = [torch.empty(size, dtype=torch.float64, device=on) for _ in range(self.world_size)]
        dist.all_gather(rows, torch.tensor(self._row(), dtype=torch.float64, device=on))
        groups: list[list[list[float]]] = [[] for _ in range(self.layout.data_parallel_size)]
        for rank, row in enumerate(rows):
            groups[self.layout.data_parallel_rank(rank)].append(row.tolist())
        windows = [
            [
                (part, max(member[CHECK_EVERY + i] for member in members))
                for i, part in enumerate(members[0][:CHECK_EVERY])
                if part > 0
            ]
            for members in groups
        ]
        speeds = [min(member[-2] for member in members) for members in groups]
        return windows, speeds, [min(member[-1] for member in members) for members in groups]

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
                f"batch_shares auto kept the even split {parts}: no other split predicts a step at least "
                f"{HYSTERESIS:.0%} shorter from the data-parallel ranks' measured steps"
            )
        line = f"batch_shares auto settled on {parts} of each global batch of {sum(self.parts)} ({self.changes} change"
        line += f"{'s' if self.changes > 1 else ''})"
        if self._even_s and self._settled_s:
            even, settled = statistics.median(self._even_s), statistics.median(self._settled_s)
            line += f"; a step takes {settled * 1e3:.1f} ms against {even * 1e3:.1f} ms at even shares "
            line += f"({even / settled:.2f}x, medians measured)"
        return line
