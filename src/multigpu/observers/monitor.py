"""What the Engine reports as it trains: memory, throughput and MFU every `log_every` steps, and every record the
loop logs, as one JSON line and to the experiment trackers `log_to` names, from the main process."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu.observers.observe import StepObserver, StepStats, leave_out
from multigpu.observers.trackers import MetricsLog, parse_log_to
from multigpu.planner.gpus import PEAK_TFLOPS

if TYPE_CHECKING:
    from torch import nn


def peak_memory_bytes(device: Any) -> int:
    """The allocator's peak on a GPU; the process's peak resident memory on CPU."""
    import resource

    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_tflops(device_name: str, precision: str, tf32: bool | None = None) -> float | None:
    """The device's dense peak for `precision`, or None where the table has no figure for it.

    `tf32`: whether fp32 matrix products may use TF32 tensor cores; torch's current setting unless given.
    """
    peak = PEAK_TFLOPS.get(device_name)
    if peak is None:
        return None
    if precision == "fp16-mixed":
        return peak.fp16
    if precision != "32":
        return peak.bf16  # None on cards that run bf16 without tensor cores: a peak they never reach
    if tf32 is None:
        import torch

        tf32 = torch.backends.cuda.matmul.allow_tf32
    return peak.tf32 if tf32 and peak.tf32 is not None else peak.fp32


def nvml_stats(device: Any) -> tuple[float, float] | None:
    """(GPU utilisation %, memory used bytes as the driver sees it) for this rank's GPU; None without NVML."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        utilisation = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        return float(utilisation), float(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # no driver library, or a GPU NVML does not manage: reported as absent, once
        return None


class StepMonitor:
    """Every `every` optimizer steps, on rank 0: each rank's memory and data+forward time, GPU utilisation,
    throughput and MFU; to the console and, where given, the metrics log. Flags ranks out of line.

    Every rank must call `add` at the same steps (it gathers one small tensor from all of them).
    """

    IMBALANCE = 1.25  # a rank this many times the median (time) or the smallest (memory) is flagged

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: Any,
        precision: str,
        every: int,
        log: MetricsLog | None,
        peak: float | None,
        say: Any,
    ) -> None:
        import torch

        self.rank, self.world_size, self.device = rank, world_size, device
        self.every, self.log, self.say = every, log, say
        name = torch.cuda.get_device_name(device) if getattr(device, "type", "cpu") == "cuda" else "CPU"
        self.peak = peak if peak is not None else peak_tflops(name, precision)
        self.flops_per_step: float | None = None  # all ranks together, counted once by the Engine
        self.batch_shares: tuple[float, ...] | None = None  # each data-parallel rank's fraction of a global batch
        self.batch_speeds: tuple[str, list[float]] | None = None  # batch_shares auto's measure of each rank's speed
        self.replicas: dict[str, int] | None = None  # the Engine's replica_quorum under fault tolerance
        self._interval: list[tuple[float, int, float, float]] = []  # (seconds, samples, tokens, data+forward s)
        if self.peak is None and every:
            say(
                f"MFU not reported: no peak FLOPS known for {name!r} in precision {precision}; pass the device's "
                "dense peak TFLOPS as --peak-tflops (Engine(peak_tflops=...) in a script) to report it."
            )

    def add(self, step: int, seconds: float, samples: int, tokens: float, busy_s: float, timed: bool) -> None:
        if not self.every:  # never reported: nothing to keep (the interval would grow by a step each step)
            return
        if timed:
            self._interval.append((seconds, samples, tokens, busy_s))
        if step % self.every == 0:
            self._report(step)
            self._interval = []

    def _report(self, step: int) -> None:
        import torch
        import torch.distributed as dist

        from multigpu.core.env import collective_device

        busy = sum(i[3] for i in self._interval) / max(len(self._interval), 1)
        gpu = nvml_stats(self.device) or (float("nan"), float("nan"))
        local = torch.tensor([busy, peak_memory_bytes(self.device), *gpu], dtype=torch.float64)
        ranks = local.unsqueeze(0)
        if self.world_size > 1:
            on = collective_device(self.device)
            parts = [torch.empty(4, dtype=torch.float64, device=on) for _ in range(self.world_size)]
            dist.all_gather(parts, local.to(on))
            ranks = torch.stack(parts).cpu()
        if self.rank != 0 or not self._interval:
            return
        seconds = sum(i[0] for i in self._interval)
        record: dict[str, Any] = {"perf/step_time_s": seconds / len(self._interval)}
        samples, tokens = sum(i[1] for i in self._interval), sum(i[2] for i in self._interval)
        if samples:
            record["perf/samples_per_s"] = samples / seconds
        if tokens:
            record["perf/tokens_per_s"] = tokens / seconds
        if self.batch_shares is not None:
            record["batch_shares"] = [round(share, 6) for share in self.batch_shares]
        if self.batch_speeds is not None:
            record[f"batch_speeds/{self.batch_speeds[0]}"] = [round(speed, 6) for speed in self.batch_speeds[1]]
        record |= self.replicas or {}  # fault tolerance: the groups in the last step's quorum, steps run again
        if self.flops_per_step is not None:
            record["perf/flops_per_step"] = self.flops_per_step
            record["perf/tflops_per_device"] = (
                self.flops_per_step * len(self._interval) / seconds / self.world_size / 1e12
            )
        if self.flops_per_step is not None and self.peak is not None:
            achieved = self.flops_per_step * len(self._interval) / seconds
            record["perf/mfu"] = achieved / (self.world_size * self.peak * 1e12)
        for r, (busy_r, memory, util, used) in enumerate(ranks.tolist()):
            record[f"memory/rank{r}_peak_mb"] = memory / 2**20
            record[f"time/rank{r}_data_forward_s"] = busy_r
            if util == util:  # not NaN: NVML answered
                record[f"gpu/rank{r}_util_pct"] = util
                record[f"gpu/rank{r}_used_mb"] = used / 2**20
        warnings = imbalance(ranks[:, 0].tolist(), ranks[:, 1].tolist(), self.IMBALANCE)
        parts = [f"step {step}", f"{record['perf/step_time_s'] * 1e3:.1f} ms/step"]
        parts += [
            f"{record[f'perf/{unit}_per_s']:,.0f} {unit}/s"
            for unit in ("samples", "tokens")
            if f"perf/{unit}_per_s" in record
        ]
        if "perf/tflops_per_device" in record:
            parts.append(f"{record['perf/tflops_per_device']:.3g} TFLOP/s per device")
        if "perf/mfu" in record:
            parts.append(f"MFU {record['perf/mfu']:.1%}")
        if self.batch_shares is not None and len(set(self.batch_shares)) > 1:
            parts.append("batch shares " + "/".join(f"{share:.3f}" for share in self.batch_shares))
        parts.append("peak MB " + "/".join(f"{m / 2**20:.0f}" for m in ranks[:, 1].tolist()))
        self.say("  ".join(parts) + "".join(f"\n  imbalance: {w}" for w in warnings))
        if self.log is not None:
            self.log.write(step, record)


def imbalance(busy: list[float], memory: list[float], ratio: float) -> list[str]:
    """What is out of line between ranks: a slow data+forward, or much more memory than the others."""
    warnings = []
    middle = sorted(busy)[len(busy) // 2]
    slow = [r for r, t in enumerate(busy) if middle > 0 and t > ratio * middle]
    if slow:
        warnings.append(
            f"rank(s) {', '.join(map(str, slow))} spend {max(busy) / middle:.2f}x the median time in data loading "
            "and forward; the others wait for them at every gradient sync (uneven data or a slower device?)"
        )
    if min(memory) > 0 and max(memory) > ratio * min(memory) and max(memory) - min(memory) > 64 * 2**20:
        heavy = memory.index(max(memory))
        warnings.append(
            f"rank {heavy} peaks at {max(memory) / min(memory):.2f}x the memory of the lightest rank "
            "(something gathered or kept on one rank only?)"
        )
    return warnings


def attention_flop_formulas() -> dict[Any, Any]:
    """torch's FLOP formulas of the fused attention ops (forward and backward), for keys and values with fewer heads
    than the queries (grouped-query attention, which transformers hands to sdpa with enable_gqa on a GPU): counted
    as the attention with those heads repeated, which is what it computes. torch before 2.13 refuses such shapes
    (an AssertionError in the step the Monitor counts)."""
    import torch
    from torch.utils import flop_counter

    def repeated(query: Any, key: Any, value: Any) -> list[tuple[int, ...]]:
        return [(shape[0], query[1], *shape[2:]) for shape in (key, value)]

    def forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return flop_counter.sdpa_flop_count(query, *repeated(query, key, value))

    def backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return flop_counter.sdpa_backward_flop_count(grad, query, *repeated(query, key, value))

    formulas = {}
    for kind in ("efficient", "flash", "cudnn"):
        for suffix, formula in (("", forward), ("_backward", backward)):
            op = getattr(torch.ops.aten, f"_scaled_dot_product_{kind}_attention{suffix}", None)
            if op is not None:
                formulas[op] = formula
    return formulas


class _NoDecomposition(dict):
    """A FlopCounterMode's formulas, keyed by op packet, that also claim every op overload so the counter
    decomposes none (see flop_counter). Counting looks formulas up by packet, so it still finds only real ones."""

    def __contains__(self, op: object) -> bool:
        import torch

        return not isinstance(op, torch._ops.OpOverloadPacket) or super().__contains__(op)


def flop_counter() -> Any:
    """A FlopCounterMode (with attention_flop_formulas) under which every op runs the kernel it runs without one.

    torch's counter runs an op it has no formula for through the op's composite form where it has one, and
    silu_backward's (every Llama MLP's backward) rounds differently from its kernel: the counted step, the second
    one each process runs, left weights that differ in the last bits from the same step uncounted. A run resumed
    at step k counted step k + 2 where the uninterrupted run counted step 2, so the resume was not bit for bit (nor
    a run with log_every 0 like one with it). The composite forms hold no matrix products, so the count is the same.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=attention_flop_formulas())
    counter.flop_registry = _NoDecomposition(counter.flop_registry)
    return counter


class Monitor(StepObserver):
    """The Engine's own metrics, attached to every Engine: a StepMonitor report every `log_every` steps, the FLOPs
    of one step for MFU (counted on the second step this process runs, whose time is then left out), and the
    records the loop logs, into `log_dir`.

    Another observer that needs the FLOPs per step sets `count_flops` once attached (bench does).
    """

    def __init__(self) -> None:
        self.count_flops = False
        self.flops_per_step: float | None = None  # all ranks together
        self._model: nn.Module | None = None  # the set-up model, whose next forward starts the count
        self._counter: Any = None  # a FlopCounterMode, from the forward it starts in to the end of that backward
        self._log: MetricsLog | None = None
        self._steps_seen = 0

    def _step_scale(self) -> float:
        """One micro-step's FLOPs -> the whole step's: read when counted, since engine.dataloader may derive the
        accumulation from global_batch_size after attach. Under uneven batch_shares this rank's batch is its
        fraction of the global batch, not 1 / data_parallel_size of it."""
        engine = self._engine
        scale = engine.config.grad_accum_steps * engine.world_size
        shares = engine.batch_shares
        if len(set(shares)) == 1:
            return scale
        return scale / (shares[engine.data_parallel_rank] * engine.data_parallel_size)

    def attach(self, engine: Any) -> None:
        config = engine.config
        self._engine = engine
        self._untimed = engine.mark_untimed
        if config.log_dir is not None and engine.is_main_process:
            self._log = MetricsLog(
                Path(config.log_dir), parse_log_to(config.log_to, config.log_dir), config.run_name, engine.print
            )
            # Under its own key: a recipe's config (engine.log_config) repeats some names with other meanings.
            self._log.log_config({"engine": asdict(config)})
        self.reports = StepMonitor(
            engine.rank,
            engine.world_size,
            engine.device,
            config.precision,
            config.log_every,
            self._log,
            config.peak_tflops,
            engine.print,
        )
        self.count_flops = bool(config.log_every)

    def on_setup(self, model: nn.Module) -> None:
        self._model = model
        if not (self.reports.every or self.count_flops):  # nothing to report or count: no hook on every step
            leave_out(self, "on_backward_end", "on_step_end")

    def _start_counting(self, module: nn.Module, args: Any) -> None:
        """A forward pre-hook for one forward: the counter runs from it to the end of the backward that follows.
        Registered for that forward only (rather than a watch on every op of every step), after the model's own
        hooks, so it starts where the Engine's forward starts (after FSDP's all-gather)."""
        self._hook.remove()
        self._counter = flop_counter()
        self._counter.__enter__()  # left at the end of the backward that follows

    def on_backward_end(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.flops_per_step = self.reports.flops_per_step = self._counter.get_total_flops() * self._step_scale()
            self._counter = None

    def on_step_end(self, stats: StepStats) -> None:
        self.reports.batch_shares, self.reports.batch_speeds = self._engine.batch_shares, self._engine.batch_speeds
        self.reports.replicas = self._engine.replica_quorum
        self.reports.add(stats.step, stats.seconds, stats.samples, stats.tokens, stats.busy_s, stats.timed)
        self._steps_seen += 1
        if self._steps_seen == 1 and self.count_flops and self._model is not None:
            # The next step, one micro-step's forward to the end of its backward.
            self._hook = self._model.register_forward_pre_hook(self._start_counting)
            self._untimed()

    def on_log(self, step: int, record: dict[str, Any]) -> None:
        if self._log is not None:
            self._log.write(step, record)

    def on_config(self, config: Mapping[str, Any]) -> None:
        if self._log is not None:
            self._log.log_config(config)

    def on_close(self) -> None:
        if self._log is not None:
            self._log.close()
