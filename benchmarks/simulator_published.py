"""The scaling simulator next to published multi-GPU results. No GPU needed: it is arithmetic.

    .venv/bin/python benchmarks/simulator_published.py

torchtitan, docs/performance.md (Dec 2024 versions): Llama 3.1 8B, 1D FSDP, bf16 parameters with fp32 gradient
reduction (torchtitan's default mixed_precision_reduce), seq len 8192, local batch 2, selective activation
checkpointing, no torch.compile: 5,762 tokens/s/GPU on 8 H100 (one node, NVLink) and 5,605 on 128 (16 nodes,
"RDMA network with 400 Gb/s per GPU"). The H100s are 96 GB HBM2e parts at a 500 W limit.

PyTorch DDP paper (Li et al., VLDB 2020), BERT figures as quoted in this project's docs: 122 samples/s/GPU on
1 GPU, 110 on 8 in one node, 80 on 2 nodes x 8. The paper's testbed is taken to be V100 servers with NVLink inside
and one 100 Gb/s NIC per server between them; the model size and per-GPU batch are assumptions (stated below).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from multigpu.planner.shapes import load_shape
from multigpu.tools.simulate import INTERCONNECTS, Link, SimulateConfig, flops_per_token, simulate

H100_BF16_PEAK = 989e12  # dense, SXM; torchtitan's 500 W HBM2e parts peak lower, so the MFU below is a floor


def per_gpu(config: SimulateConfig, gpus: int, intra: Link, inter: Link) -> float:
    (p,) = simulate(dataclasses.replace(config, gpus=(gpus,)), intra=intra, inter=inter)
    return p.per_gpu_throughput


def solve(throughput: Callable[[float], float], target: float, low: float, high: float) -> float:
    """The x in [low, high] at which the increasing function `throughput` meets `target` (bisection)."""
    for _ in range(100):
        mid = (low + high) / 2
        if throughput(mid) > target:
            high = mid
        else:
            low = mid
    return (low + high) / 2


rows: list[tuple[str, float, float]] = []
notes: list[str] = []

# torchtitan: compute anchored on the published 8-GPU figure (one node: only NVLink collectives, which FSDP hides
# almost entirely), then 128 GPUs predicted with InfiniBand between nodes.
shape = load_shape("llama-3.1-8b")
tokens = 2 * 8192
titan = SimulateConfig(
    params=shape.params,
    layers=shape.transformer.layers,
    compute_s=1.0,
    units_per_step=tokens,
    unit="tokens",
    strategy="fsdp",
    param_bytes=2,
    grad_bytes=4,
    interconnect="infiniband",
    intra="nvlink",
)
nvlink, infiniband = INTERCONNECTS["nvlink"], INTERCONNECTS["infiniband"]
# Per-GPU throughput falls as compute_s grows; negated, it rises, as solve() wants.
compute_s = solve(
    lambda c: -per_gpu(dataclasses.replace(titan, compute_s=c), 8, nvlink, infiniband), -5762, 1e-3, tokens / 5762
)
titan = dataclasses.replace(titan, compute_s=compute_s)
rows.append(("torchtitan Llama-3.1-8B FSDP, 8 H100 (anchor)", 5762, per_gpu(titan, 8, nvlink, infiniband)))
rows.append(("torchtitan Llama-3.1-8B FSDP, 128 H100", 5605, per_gpu(titan, 128, nvlink, infiniband)))
mfu = flops_per_token(shape, 8192) * tokens / titan.compute_s / H100_BF16_PEAK
notes.append(
    f"torchtitan: compute {titan.compute_s:.3f} s/step anchored on 8 GPUs = {mfu:.1%} MFU of the SXM peak "
    "(torchtitan reports 33-39%), a consistency check on the anchor."
)

# DDP paper: BERT-large, fp32 gradients in 25 MiB buckets, compute anchored on the 1-GPU figure.
BATCH = 32  # samples per GPU per step: an assumption, the figures quoted do not give it
v100_nvlink = Link(alpha_s=5e-6, bandwidth_Bps=120e9)  # assumed: NVLink2 8xV100 ring all-reduce, ~120 GB/s bus
one_nic = Link(alpha_s=10e-6, bandwidth_Bps=12.2e9)  # one 100 Gb/s NIC per node: 12.2 GB/s (NVIDIA/nccl-tests#29)
bert = SimulateConfig(
    params=340_000_000, layers=24, compute_s=BATCH / 122, units_per_step=BATCH, strategy="ddp", grad_bytes=4
)
rows.append(("DDP paper BERT-large, 1 V100 (anchor)", 122, per_gpu(bert, 1, v100_nvlink, one_nic)))
rows.append(("DDP paper BERT-large, 8 V100, 1 node", 110, per_gpu(bert, 8, v100_nvlink, one_nic)))
rows.append(("DDP paper BERT-large, 2 x 8 V100", 80, per_gpu(bert, 16, v100_nvlink, one_nic)))
base = dataclasses.replace(bert, params=110_000_000, layers=12)
rows.append(("  same, BERT-base (110M) instead", 80, per_gpu(base, 16, v100_nvlink, one_nic)))


def bert_at(batch: float) -> float:
    return per_gpu(dataclasses.replace(bert, compute_s=batch / 122, units_per_step=batch), 16, v100_nvlink, one_nic)


sweep = ", ".join(f"batch {batch} -> {bert_at(batch):.0f}" for batch in (8, 16, 32, 64))
notes.append(f"BERT-large on 2 x 8 V100 by per-GPU batch: {sweep}; {solve(bert_at, 80, 1, 256):.0f} would give 80.")

print(f"{'setting':<48} {'published':>10} {'predicted':>10} {'error':>8}")
for setting, published, predicted in rows:
    error = round((predicted - published) / published, 4) + 0.0  # + 0.0 turns -0.0 into 0.0
    print(f"{setting:<48} {published:>10,.0f} {predicted:>10,.0f} {error:>+8.1%}")
print("units: tokens/s/GPU (torchtitan), samples/s/GPU (DDP paper)")
for note in notes:
    print("-", note)
print(
    "- Assumed for BERT: per-GPU batch 32, fp32 gradients, V100 NVLink ~120 GB/s bus, one 100 Gb/s NIC per node;\n"
    "  the paper text could not be checked here, so model size, batch and network are assumptions.\n"
    "- Inside one node the model predicts almost no loss (NVLink all-reduce of 25 MiB buckets hides under\n"
    "  backward); the published 8-GPU drop (122 -> 110) likely comes from what the model leaves out: NCCL\n"
    "  kernels taking SMs and memory bandwidth from backward, bucket copies, waiting on the slowest rank.\n"
    "- Across nodes the prediction hangs on the per-GPU batch (compute to hide behind) and the NIC: see the\n"
    "  batch sweep above. torchtitan's 2.7% loss at 128 GPUs is likewise beyond a model in which InfiniBand\n"
    "  at 8 x 46 GB/s per node keeps every gather hidden: stragglers and network contention are not modelled."
)
