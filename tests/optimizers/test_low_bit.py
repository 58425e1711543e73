"""AdamW with its states in bfloat16, 8 and 4 bits, in one process: the states' bytes (the planner's figures),
rounding that moves a bfloat16 state as float32 would on average, and checkpoints that resume exactly. (Under zero3
on 2 processes, resumed there and on 1: tests/strategies/test_model_parallel.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from multigpu.config.optimizer import LOW_BIT, OptimizerSettings
from multigpu.optimizers import build_optimizer
from multigpu.optimizers.low_bit import hashed_round, saved_values
from multigpu.planner.states import LOW_BIT_STATE_BYTES


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 8))


def train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 4) -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        nn.functional.cross_entropy(net(x), torch.arange(16) % 8).backward()
        optimizer.step()
        optimizer.zero_grad()


def state_bytes(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int:
    """Bytes of a parameter's two moment states as stored (a quantised state's codes and scales)."""
    total = 0
    for key in ("exp_avg", "exp_avg_sq"):
        state = optimizer.state[param][key]
        parts = [state.codes, state.scale] if hasattr(state, "codes") else [state]
        total += sum(part.numel() * part.element_size() for part in parts)
    return total


@pytest.mark.parametrize("name", LOW_BIT)
def test_the_states_take_the_bytes_the_planner_counts(name: str) -> None:
    net = model()
    optimizer = build_optimizer(net, OptimizerSettings(optimizer=name), lr=1e-3)
    train(net, optimizer, steps=1)
    big = net[0].weight  # 8,192 values: quantised (under 4,096 a state stays float32, too few to count)
    assert state_bytes(optimizer, big) == pytest.approx(big.numel() * LOW_BIT_STATE_BYTES[name], rel=1e-6)


@pytest.mark.parametrize("name", LOW_BIT)
def test_a_checkpointed_low_bit_optimizer_resumes_exactly(name: str) -> None:
    settings = OptimizerSettings(optimizer=name)
    first = model()
    optimizer = build_optimizer(first, settings, lr=1e-3)
    train(first, optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    assert all(not hasattr(value, "codes") for entry in saved["state"].values() for value in entry.values())
    second = copy.deepcopy(first)
    resumed = build_optimizer(second, settings, lr=1e-3)
    resumed.load_state_dict(saved)
    train(first, optimizer)
    train(second, resumed)
    for mine, other in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(mine, other)


def test_a_quantised_state_saved_quantises_back_to_its_codes_and_scales() -> None:
    from torchao.optim.subclass_8bit import OptimState8bit

    values = torch.randn(4096) * 1e-3
    values[:256] = values[:256].abs()
    values[7] = -1e-2  # the first block's largest magnitude, negative: the signed map ends at -0.99
    state = OptimState8bit.zeros(values.shape, True, 256)
    state.copy_(values)
    again = OptimState8bit.zeros(values.shape, True, 256)
    again.copy_(saved_values(state))
    assert torch.equal(again.codes, state.codes) and torch.equal(again.scale, state.scale)
    plain = OptimState8bit.zeros(values.shape, True, 256)
    plain.copy_(state.dequantize())
    assert not torch.equal(plain.scale, state.scale)  # what the saved values avoid


def test_hashed_rounding_is_unbiased_and_the_same_for_the_same_value_and_step() -> None:
    # Values around an eighth of the way from one bfloat16 to the next (2**-7 apart): 8,192 float32s, each hashed
    # to noise of its own. Their mean rounds up with a chance of 1/8, within 1.5e-4 (5 standard deviations of
    # 8,192 draws); rounding to nearest would take them all down, 9.8e-4 off.
    jittered = 1.0 + 2**-10 + torch.linspace(-(2**-11), 2**-11, 100_000)
    rounded = hashed_round(jittered, torch.tensor(3.0), salt=1).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert rounded.mean().item() == pytest.approx(jittered.mean().item(), abs=1.5e-4)
    assert torch.equal(rounded, hashed_round(jittered, torch.tensor(3.0), salt=1).float())
    assert not torch.equal(rounded, hashed_round(jittered, torch.tensor(4.0), salt=1).float())
    exact = torch.tensor([1.0, -2.5, 0.0, 3.0 * 2**-30])
    assert torch.equal(hashed_round(exact, torch.tensor(1.0), salt=2).float(), exact)


def test_bfloat16_states_move_as_float32_ones_where_round_to_nearest_would_stall() -> None:
    """exp_avg_sq moves by (1 - beta2) = 0.1% of the gap per step, under bfloat16's half-step of 0.4% near 1."""
    ours, theirs = nn.Parameter(torch.ones(4096)), nn.Parameter(torch.ones(4096))
    bf16 = build_optimizer(nn.ParameterList([ours]), OptimizerSettings(optimizer="adamw-bf16"), lr=0.0)
    fp32 = torch.optim.AdamW([theirs], lr=0.0)
    gradients = 1.0 + torch.rand(4096, generator=torch.Generator().manual_seed(0))
    for step in range(300):
        for param in (ours, theirs):
            param.grad = gradients * (1.0 if step < 100 else 1.5)  # the squares jump, then creep toward 2.25x
        bf16.step()
        fp32.step()
    got, want = bf16.state[ours]["exp_avg_sq"].float().mean(), fp32.state[theirs]["exp_avg_sq"].mean()
    assert got.item() == pytest.approx(want.item(), rel=2e-3)
    nearest = want.to(torch.bfloat16).float()  # what rounding to nearest could at best hold
    assert abs(got - want) < abs(nearest - want) or nearest == want
