"""Float8 training on a real GPU: torch's float8 matrix products (not the CPU's emulation) on GPUs of compute
capability 8.9 or newer, and the one-sentence refusal on older ones. The model, its training loop and the
tolerances are the CPU tests' (tests/transforms/test_float8.py), which say how they were measured."""

from __future__ import annotations

import pytest
import torch

import multigpu as mg
from multigpu.core.errors import UsageError
from tests.dist import run_in_processes
from tests.transforms.test_float8 import CONVERTED, FLOAT8_VS_PLAIN, FP32_NOISE, Net, deviation, train

has_float8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_float8 = pytest.mark.skipif(not has_float8, reason="needs a GPU of compute capability 8.9 or newer")


@pytest.mark.skipif(has_float8, reason="this GPU has float8")
def test_an_older_gpu_is_refused_in_one_sentence() -> None:
    with pytest.raises(UsageError, match=r"needs a GPU of compute capability 8\.9 or newer"):
        mg.Engine("single", float8="tensorwise")


@needs_float8
@pytest.mark.parametrize("precision", ["bf16-mixed", "32"])
def test_float8_runs_on_the_gpu_close_to_plain(precision: str) -> None:
    plain = train("single", precision=precision)
    for recipe in ("tensorwise", "rowwise"):
        found = train("single", recipe, precision)
        assert found["float8"] == CONVERTED
        assert FP32_NOISE < deviation(found["losses"], plain["losses"]) < FLOAT8_VS_PLAIN, recipe


@needs_float8
def test_the_gpu_layers_are_not_emulated() -> None:
    engine = mg.Engine("single", float8="tensorwise")
    model, _ = engine.setup(Net())
    layers = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    assert len(layers) == 4 and not any(layer.config.emulate for layer in layers)
    with pytest.raises(UsageError, match="micro-batch has 10"):
        model(torch.randn(10, 8, device=engine.device)).sum().backward()


@needs_float8
def test_zero3_all_gathers_in_float8_over_nccl() -> None:
    """One process of NCCL: FSDP's all-gather of float8 weights and the post-step scales, in bf16-mixed."""
    (found,) = run_in_processes(
        "tests.transforms.test_float8:train", 1, strategy="zero3", float8="tensorwise", precision="bf16-mixed"
    )
    assert found["gathered_in_float8"] == found["scaled_after_step"] == 4
    expected = train("single", "tensorwise", "bf16-mixed")
    assert deviation(found["losses"], expected["losses"]) < FLOAT8_VS_PLAIN
