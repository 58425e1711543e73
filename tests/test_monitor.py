"""The monitor's pure parts: peak FLOPS lookup and the imbalance flags."""

import torch

from multigpu.monitor import imbalance, peak_tflops


def test_peak_tflops_by_device_name_and_precision() -> None:
    assert peak_tflops("NVIDIA H100 PCIe", "bf16-mixed") == 756.0  # the PCIe entry, not the SXM one
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16-mixed") == 312.0
    tf32 = torch.backends.cuda.matmul.allow_tf32
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "32") == (156.0 if tf32 else 19.5)
    assert peak_tflops("CPU", "32") is None


def test_imbalance_flags_the_slow_rank_and_the_heavy_rank() -> None:
    mb = 2**20
    assert imbalance([1.0, 1.05, 0.98, 1.02], [500 * mb] * 4, 1.25) == []
    (slow,) = imbalance([1.0, 1.0, 1.6, 1.0], [500 * mb] * 4, 1.25)
    assert slow.startswith("rank(s) 2 spend 1.60x the median time")
    (heavy,) = imbalance([1.0, 1.0], [500 * mb, 900 * mb], 1.25)
    assert heavy.startswith("rank 1 peaks at 1.80x the memory")
    assert imbalance([1.0, 1.0], [10 * mb, 20 * mb], 1.25) == []  # a few MB apart is noise, not imbalance
