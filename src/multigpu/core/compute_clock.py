"""How fast this rank computes, without the time it waits for others (batch_shares auto, pp_split auto).

On a CPU: a thread's time on a CPU plus its time waiting for one (Linux's schedstat). A wait in a collective
sleeps and counts in neither; a co-tenant on the rank's core lengthens the wait for a CPU, so the rank counts as
slower, as it is. batch_shares auto reads it summed over the rank's threads from one step's end to the next: a
rank's fixed work per step (its optimizer step, Python's launch of each op, gloo's threads' share of the
all-reduce) counts beside its per-sample work, as it does in the step's time. Measured on the main thread alone,
the slow rank's communication went uncounted and auto settled at 45:19 where 48:16 is faster.
On a GPU the kernels run behind the collectives' on the same stream, so a rank's own work is timed as a fixed matrix
product between CUDA events: its device's speed as it runs now (clocks throttled, a co-tenant's kernels).
"""

from __future__ import annotations

from pathlib import Path

import torch

from multigpu.core.errors import UsageError

SCHEDSTAT = Path("/proc/thread-self/schedstat")
TASKS = Path("/proc/self/task")
#: The probe: (side of its square matrices, products, dtype) per device type; long enough for its clock to time
#: (~0.5 TFLOP on a GPU, ~2.7 GFLOP on a CPU core).
PROBE = {"cuda": (4096, 4, torch.bfloat16), "cpu": (512, 10, torch.float32)}


def process_demand_s() -> float:
    """The same, summed over this process's threads: gloo's threads do a rank's communication, and beside a
    co-tenant they wait for a CPU as the main thread does, while the main thread sleeps in the collective."""
    total = 0
    for task in TASKS.iterdir():
        try:
            on_cpu, waiting, _ = (task / "schedstat").read_text().split()
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        total += int(on_cpu) + int(waiting)
    return total / 1e9


def check_measurable(device_type: str, setting: str) -> None:
    """One sentence where `setting` (auto) cannot measure this machine's CPU ranks."""
    if device_type != "cuda" and not SCHEDSTAT.exists():
        raise UsageError(
            f"{setting} auto measures each CPU rank's compute from the kernel's {SCHEDSTAT}, which this system does "
            f"not have; give {setting} by hand."
        )


def cpu_demand_s() -> float:
    """This thread's seconds on a CPU plus its seconds waiting for one, since it started."""
    on_cpu, waiting, _ = SCHEDSTAT.read_text().split()
    return (int(on_cpu) + int(waiting)) / 1e9


def probe_tflop(device_type: str) -> float:
    """The probe's work, in TFLOP."""
    side, products, _ = PROBE["cuda" if device_type == "cuda" else "cpu"]
    return 2 * side**3 * products / 1e12


def probe_s(device: torch.device) -> float:
    """Seconds this rank takes for the probe's matrix products, as its device runs now."""
    side, products, dtype = PROBE["cuda" if device.type == "cuda" else "cpu"]
    matrix = torch.randn(side, side, device=device, dtype=dtype)
    if device.type != "cuda":
        start = cpu_demand_s()
        for _ in range(products):
            torch.mm(matrix, matrix)
        return cpu_demand_s() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.mm(matrix, matrix)  # the first product pays for the library's set-up
    begin.record()
    for _ in range(products):
        torch.mm(matrix, matrix)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3
