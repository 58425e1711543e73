"""A checkpoint of one AdamW resumed with another, in one process through the Engine: every direction loads and says
so in one line; a float32 AdamW holds the saved optimizer's states bit for bit, and a narrower one holds them as
its own steps would round them. An optimizer whose states are of another kind is refused in one sentence.
(The recipes' resumes, in real processes: tests/recipes/test_finetune.py.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu as mg
from multigpu.optimizers.convert import ADAMW_KINDS


def trained(kind: str, steps: int) -> tuple[mg.Engine, dict]:
    """A small MLP and its optimizer `kind` after `steps` steps; its 8,192-value weight quantises in 8 and 4 bits,
    the rest stays float32."""
    engine = mg.Engine(strategy="single", optimizer=kind)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    model, optimizer = engine.setup(model, engine.optimizer(model, 1e-2))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        nn.functional.cross_entropy(model(x), torch.arange(16) % 8).backward()
        optimizer.step()
        optimizer.zero_grad()
    return engine, {"model": model, "optimizer": optimizer, "step": steps}


def held(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """Each parameter's moments as the optimizer holds them, in float32 (a quantised one read back)."""
    states = [optimizer.state[param] for group in optimizer.param_groups for param in group["params"]]
    return [
        {key: (value.dequantize() if hasattr(value, "dequantize") else value).float() for key, value in state.items()}
        for state in states
    ]


def as_kept_by(kind: str, values: torch.Tensor, signed: bool) -> torch.Tensor:
    """`values` as a fresh optimizer `kind` keeps them, through torchao's own quantisation (tensors under 4,096
    values stay float32)."""
    if kind == "adamw":
        return values
    if kind == "adamw-bf16":
        return values.bfloat16().float()
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    if values.numel() < 4096:
        return values
    state = OptimState8bit.zeros(values.shape, signed, 256) if kind == "adamw-8bit" else None
    if kind == "adamw-4bit":
        state = OptimState4bit.zeros(values.shape, signed, 128)
    state.copy_(values)
    return state.dequantize()


@pytest.mark.parametrize(("source", "target"), list(itertools.permutations(ADAMW_KINDS, 2)))
def test_an_adamw_checkpoint_resumes_with_any_other_adamw(
    source: str, target: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    engine, state = trained(source, steps=3)
    saved = engine.save(tmp_path / "step-3", state)
    before = held(state["optimizer"])
    capsys.readouterr()
    resumed, fresh = trained(target, steps=0)
    resumed.load(saved, fresh)
    how = "exact" if target == "adamw" else "rounded to the nearest bfloat16" if target == "adamw-bf16" else "bits"
    lines = [line for line in capsys.readouterr().out.splitlines() if "converted" in line]
    assert len(lines) == 1 and lines[0].startswith(f"resume: optimizer states converted from {source} to {target} (")
    assert how in lines[0], lines[0]
    for mine, theirs in zip(held(fresh["optimizer"]), before, strict=True):
        assert torch.equal(mine["step"], theirs["step"])
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            # Widening (any state into float32) is bit for bit; narrowing rounds as the target itself rounds.
            assert torch.equal(mine[key], as_kept_by(target, theirs[key], signed)), key
    group = fresh["optimizer"].param_groups[0]
    assert group["lr"] == state["optimizer"].param_groups[0]["lr"]
    if target == "adamw":  # torch's settings that torchao's optimizers do not save keep the optimizer's own
        assert group["maximize"] is False and group["foreach"] is None
    nn.functional.cross_entropy(fresh["model"](torch.randn(4, 64)), torch.arange(4)).backward()
    fresh["optimizer"].step()  # and it steps on


def test_an_optimizer_with_other_states_is_refused_in_one_sentence(tmp_path: Path) -> None:
    engine, state = trained("adamw", steps=1)
    saved = engine.save(tmp_path / "step-1", state)
    _, other = trained("sgd", steps=0)
    with pytest.raises(mg.UsageError, match="holds the states of optimizer adamw, which optimizer sgd does not take"):
        engine.load(saved, other)
