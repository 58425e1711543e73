"""Where metrics go: one JSON line per record, and TensorBoard, from the main process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where metrics are written

        directory.mkdir(parents=True, exist_ok=True)
        self._jsonl = (directory / "metrics.jsonl").open("a")
        self._tensorboard = SummaryWriter(str(directory / "tensorboard"))

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tensorboard.add_scalar(key, value, step)
        self._tensorboard.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._tensorboard.close()


def peak_memory_bytes(device: Any) -> int:
    """The allocator's peak on a GPU; the process's peak resident memory on CPU."""
    import resource

    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# Dense (no sparsity) peak TFLOPS from NVIDIA's datasheets: (16-bit tensor cores, TF32 tensor cores, plain FP32).
# Matched against torch.cuda.get_device_name() in this order, so the more specific names come first.
PEAK_TFLOPS: dict[str, tuple[float, float, float]] = {
    "H200": (989.4, 494.7, 66.9),
    "H100 PCIe": (756.0, 378.0, 51.2),
    "H100": (989.4, 494.7, 66.9),  # SXM
    "A100": (312.0, 156.0, 19.5),
    "L40S": (362.0, 183.0, 91.6),
    "L4": (121.0, 60.0, 30.3),
    "A10": (125.0, 62.5, 31.2),
    "V100": (125.0, 15.7, 15.7),  # fp16 tensor cores; no bf16 or TF32
    "T4": (65.0, 8.1, 8.1),
    "RTX 4090": (165.2, 82.6, 82.6),
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The device's dense peak for `precision`, or None where the table has no entry for it."""
    for name, (half, tf32, fp32) in PEAK_TFLOPS.items():
        if name in device_name:
            if precision != "32":
                return half
            import torch

            return tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32
    return None


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
        self._interval: list[tuple[float, int, float, float]] = []  # (seconds, samples, tokens, data+forward s)
        if self.peak is None and every:
            say(f"MFU not reported: no peak FLOPS known for {name}; pass peak_tflops to report it.")

    def add(self, step: int, seconds: float, samples: int, tokens: float, busy_s: float, timed: bool) -> None:
        if timed:
            self._interval.append((seconds, samples, tokens, busy_s))
        if self.every and step % self.every == 0:
            self._report(step)
            self._interval = []

    def _report(self, step: int) -> None:
        import torch
        import torch.distributed as dist

        busy = sum(i[3] for i in self._interval) / max(len(self._interval), 1)
        gpu = nvml_stats(self.device) or (float("nan"), float("nan"))
        local = torch.tensor([busy, peak_memory_bytes(self.device), *gpu], dtype=torch.float64)
        ranks = local.unsqueeze(0)
        if self.world_size > 1:
            on = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
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
