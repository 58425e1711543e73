"""`multigpu env`: the guides' pre-flight checklist in one command.

Versions, GPUs and their memory, topology and peer access, the launcher variables that are set, and an
all-reduce smoke test in N real processes with its bandwidth. Says what it cannot check on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch
import torch.distributed as dist

VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
)
PREFIXES = ("NCCL_", "GLOO_", "SLURM_", "OMPI_COMM_WORLD_", "TORCH_DISTRIBUTED", "TORCHELASTIC_")


def facts() -> tuple[list[tuple[str, str]], list[str]]:
    """(label, value) lines about this machine, and the problems found, each with its advice."""
    lines = [("python", sys.version.split()[0]), ("torch", torch.__version__)]
    problems = []
    cuda = torch.cuda.is_available()
    lines.append(("CUDA", f"{torch.version.cuda} ({torch.cuda.device_count()} GPU(s) visible)" if cuda else "no GPU"))
    lines.append(("backends", ", ".join(b for b in ("nccl", "gloo", "mpi") if getattr(dist, f"is_{b}_available")())))
    if cuda:
        lines.append(("NCCL", ".".join(map(str, torch.cuda.nccl.version()))))
        count = torch.cuda.device_count()
        for index in range(count):
            props = torch.cuda.get_device_properties(index)
            lines.append((f"GPU {index}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
        if count > 1:
            peers = [
                f"{a}->{b}"
                for a in range(count)
                for b in range(count)
                if a != b and not torch.cuda.can_device_access_peer(a, b)
            ]
            lines.append(("peer access", "all pairs" if not peers else f"missing for {', '.join(peers)}"))
            if peers:
                problems.append(
                    "Some GPUs lack peer access: NCCL goes through host memory (slower); "
                    "if collectives hang, try NCCL_P2P_DISABLE=1."
                )
        if not dist.is_nccl_available():
            problems.append("This torch has no NCCL: install a CUDA build of torch to train on GPUs.")
    else:
        lines.append(("GPU checks", "skipped: no GPU here (memory, NCCL, topology and peer access need one)"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible not in (None, "") and cuda and len(visible.split(",")) > torch.cuda.device_count():
        problems.append(f"CUDA_VISIBLE_DEVICES={visible} names more GPUs than are present; fix or unset it.")
    smi = shutil.which("nvidia-smi")
    if smi:
        topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30)
        lines.append(("topology", topo.stdout.strip() or topo.stderr.strip()))
    else:
        lines.append(("topology", "not checked: nvidia-smi not found"))
    set_vars = {k: v for k, v in os.environ.items() if k in VARIABLES or k.startswith(PREFIXES)}
    lines.append(("variables", ", ".join(f"{k}={v}" for k, v in sorted(set_vars.items())) or "none set"))
    return lines, problems


def smoke_test(nproc: int, size_mb: float, iterations: int) -> dict | None:
    """An all-reduce of `size_mb` MB timed in `nproc` processes, by the collectives benchmark; None if it failed."""
    from multigpu.tools.collectives import BenchmarkFailed, CollectivesConfig, run_collectives

    size = max(4, int(size_mb * 2**20 / 4) * 4)
    # warmup=0: the benchmark's first call, the checked one, is the warm-up.
    config = CollectivesConfig(nproc, "all_reduce", size, size, iterations=iterations, warmup=0)
    try:
        result = run_collectives(config)
    except BenchmarkFailed:
        return None
    (row,) = result["results"]
    return {
        "backend": result["backend"],
        "world": result["world_size"],
        "correct": row["correct"],
        "seconds": row["time_s"],
        "algbw_GBps": row["algbw_GBps"],
        "busbw_GBps": row["busbw_GBps"],
    }


def run(nproc: int, size_mb: float, iterations: int, as_json: bool) -> int:
    lines, problems = facts()
    smoke = smoke_test(nproc, size_mb, iterations)
    if smoke is None:
        problems.append(
            f"The {nproc}-process all-reduce failed (see above): check MASTER_ADDR/ports, firewalls, "
            "and NCCL_DEBUG=INFO output."
        )
    elif not smoke["correct"]:
        problems.append("The all-reduce returned wrong values: the interconnect or driver is faulty.")
    if as_json:
        print(json.dumps({"facts": dict(lines), "smoke_test": smoke, "problems": problems}, indent=2))
    else:
        for label, value in lines:
            print(f"{label:>12}: {value}")
        if smoke:
            print(
                f"{'all-reduce':>12}: {smoke['world']} processes on {smoke['backend']}, {size_mb:g} MB: "
                f"{smoke['seconds'] * 1e3:.2f} ms, algbw {smoke['algbw_GBps']:.2f} GB/s, "
                f"busbw {smoke['busbw_GBps']:.2f} GB/s, {'correct' if smoke['correct'] else 'WRONG'}"
            )
        for problem in problems:
            print(f"{'problem':>12}: {problem}")
        print(f"{'verdict':>12}: {'ready' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0
