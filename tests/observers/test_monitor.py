"""The monitor's pure parts: peak FLOPS lookup, the imbalance flags and the attention FLOP formulas."""

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from multigpu.observers.monitor import StepMonitor, attention_flop_formulas, flop_counter, imbalance, peak_tflops


def test_peak_tflops_by_device_name_and_precision() -> None:
    assert peak_tflops("NVIDIA H100 PCIe", "bf16-mixed") == 756.0  # the PCIe entry, not the SXM one
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16-mixed") == 312.0
    tf32 = torch.backends.cuda.matmul.allow_tf32
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "32") == (156.0 if tf32 else 19.5)
    assert peak_tflops("CPU", "32") is None


@pytest.mark.parametrize(
    ("name", "half"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-40GB", 312.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA A10", 125.0),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("Tesla V100-SXM2-32GB", 125.0),
        ("Tesla T4", 65.0),
        ("NVIDIA GeForce RTX 4090", 165.2),
    ],
)
def test_exact_device_names_find_their_fp16_peak(name: str, half: float) -> None:
    assert peak_tflops(name, "fp16-mixed") == half


@pytest.mark.parametrize(
    "name", ["NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A10G", "NVIDIA L40", "Tesla V100-PCIE-16GB", "NVIDIA H100"]
)
def test_near_miss_names_have_no_peak_rather_than_a_neighbours(name: str) -> None:
    assert peak_tflops(name, "bf16-mixed") is None


def test_cards_without_bf16_or_tf32_tensor_cores() -> None:
    assert peak_tflops("Tesla V100-SXM2-32GB", "bf16-mixed") is None  # bf16 runs there, but not on tensor cores
    assert peak_tflops("Tesla T4", "bf16-true") is None
    assert peak_tflops("Tesla T4", "32", tf32=True) == 8.1  # no TF32: plain FP32 whatever torch allows
    assert peak_tflops("NVIDIA L4", "32", tf32=True) == 60.0
    assert peak_tflops("NVIDIA L4", "32", tf32=False) == 30.3


def test_an_unknown_device_is_named_once_with_the_flag_that_fixes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 NVL")
    said: list[str] = []
    StepMonitor(0, 1, SimpleNamespace(type="cuda"), "bf16-mixed", 10, None, None, said.append)
    [message] = said
    assert "'NVIDIA H100 NVL'" in message and "--peak-tflops" in message
    said.clear()
    StepMonitor(0, 1, SimpleNamespace(type="cuda"), "bf16-mixed", 10, None, 835.0, said.append)
    assert said == []  # a given peak needs no lookup


def test_imbalance_flags_the_slow_rank_and_the_heavy_rank() -> None:
    mb = 2**20
    assert imbalance([1.0, 1.05, 0.98, 1.02], [500 * mb] * 4, 1.25) == []
    (slow,) = imbalance([1.0, 1.0, 1.6, 1.0], [500 * mb] * 4, 1.25)
    assert slow.startswith("rank(s) 2 spend 1.60x the median time")
    (heavy,) = imbalance([1.0, 1.0], [500 * mb, 900 * mb], 1.25)
    assert heavy.startswith("rank 1 peaks at 1.80x the memory")
    assert imbalance([1.0, 1.0], [10 * mb, 20 * mb], 1.25) == []  # a few MB apart is noise, not imbalance


def test_grouped_query_attention_is_counted_as_its_query_heads_attending(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 query heads over 2 key/value heads (enable_gqa's shapes), on the meta device: the fused kernels' forward
    and backward counted as attention over 8 heads, through torch's counts made as strict as torch 2.11's (which
    raise where the key and value have fewer heads than the query)."""
    from torch.utils import flop_counter
    from torch.utils.flop_counter import FlopCounterMode

    def strict(count: Any, query_at: int) -> Any:
        def checked(*shapes: Any) -> int:
            assert all(shape[1] == shapes[query_at][1] for shape in shapes), shapes
            return count(*shapes)

        return checked

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", strict(flop_counter.sdpa_flop_count, 0))
    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", strict(flop_counter.sdpa_backward_flop_count, 1))

    def flops(op: object, *args: object) -> int:
        with FlopCounterMode(display=False, custom_mapping=attention_flop_formulas()) as counter:
            op(*args)
        return counter.get_total_flops()

    aten, meta = torch.ops.aten, {"device": "meta"}
    batch, heads, kv_heads, length, dim = 2, 8, 2, 16, 4
    q = torch.empty(batch, heads, length, dim, **meta)
    k, v = (torch.empty(batch, kv_heads, length, dim, **meta) for _ in range(2))
    seed, empty = torch.empty(2, dtype=torch.long, **meta), torch.empty(0, **meta)
    product = 2 * batch * heads * length * length * dim  # one [length, dim] x [dim, length] product per query head
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
    assert flops(aten._scaled_dot_product_efficient_attention, q, k, v, None, True) == 2 * product  # scores, values
    assert flops(aten._scaled_dot_product_flash_attention, q, k, v) == 2 * product
    # The scores again, then four products for the gradients.
    backward = (out, q, k, v, None, out, lse, seed, empty, 0.0, [True, True, True, False])
    assert flops(aten._scaled_dot_product_efficient_attention_backward, *backward) == 5 * product


def test_the_flop_count_leaves_every_op_as_it_runs_uncounted() -> None:
    """A Llama MLP's forward and backward: bitwise the same gradients under the counter as without it (torch's own
    counter runs silu_backward through its composite form, which rounds differently), and the same count."""
    from torch.utils.flop_counter import FlopCounterMode

    generator = torch.Generator().manual_seed(0)
    x, gate, down = (torch.randn(*shape, generator=generator) for shape in ((64, 32), (32, 128), (128, 32)))

    def gradient() -> torch.Tensor:
        weight = gate.clone().requires_grad_()
        (torch.nn.functional.silu(x @ weight) @ down).square().sum().backward()
        return weight.grad

    plain = gradient()
    with flop_counter() as counter:
        counted = gradient()
    with FlopCounterMode(display=False) as torchs:
        gradient()
    assert torch.equal(counted, plain)
    # Two products forward, one each backward (for the weight's gradient and for the activations').
    assert counter.get_total_flops() == torchs.get_total_flops() == 4 * 2 * 64 * 32 * 128
