"""Muon in one process: torch's update for the matrices, torch's AdamW for the rest, the matrices chosen as Moonlight
chooses them. (N processes against one, under every layout: tests/strategies/test_model_parallel.py and
tests/parallel/test_experts.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from multigpu.config.optimizer import OptimizerSettings
from multigpu.core.errors import UsageError
from multigpu.optimizers import Muon, build_optimizer, muon_groups


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.hidden(self.embed(tokens)).relu()))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    tokens = torch.arange(32) % 32
    for _ in range(steps):
        nn.functional.cross_entropy(model(tokens), tokens % 5).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_the_hidden_matrices_go_to_muon_and_the_embeddings_head_and_norms_to_adamw() -> None:
    model = Classifier()
    hidden, rest = muon_groups(model, "hidden")
    assert [p is model.hidden.weight for p in hidden["params"]] == [True]
    assert {id(p) for p in rest["params"]} == {id(p) for p in model.parameters()} - {id(model.hidden.weight)}
    every = muon_groups(model, "matrices")[0]["params"]
    assert {id(p) for p in every} == {id(model.embed.weight), id(model.hidden.weight), id(model.head.weight)}


def test_muon_steps_the_matrices_as_torch_muon_and_the_rest_as_torch_adamw() -> None:
    torch.manual_seed(0)
    ours, theirs = Classifier(), Classifier()
    theirs.load_state_dict(ours.state_dict())
    settings = OptimizerSettings(optimizer="muon", weight_decay=0.1)
    train(ours, build_optimizer(ours, settings, lr=1e-2))
    matrix = [theirs.hidden.weight]
    rest = [p for p in theirs.parameters() if p is not theirs.hidden.weight]
    torch_muon = torch.optim.Muon(matrix, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    torch_adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)
    tokens = torch.arange(32) % 32
    for _ in range(3):
        nn.functional.cross_entropy(theirs(tokens), tokens % 5).backward()
        for optimizer in (torch_muon, torch_adamw):
            optimizer.step()
            optimizer.zero_grad()
    for (name, mine), other in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine, other), name


def test_a_stack_of_experts_is_orthogonalised_one_matrix_at_a_time() -> None:
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(3, 8, 6))
    singles = [nn.Parameter(matrix.detach().clone()) for matrix in stack]
    gradient = torch.randn(3, 8, 6)
    stack.grad = gradient.clone()
    for single, grad in zip(singles, gradient, strict=True):
        single.grad = grad.clone()
    Muon([stack], lr=0.1).step()
    Muon(singles, lr=0.1).step()
    assert torch.equal(stack.detach(), torch.stack([single.detach() for single in singles]))


def test_muon_refuses_what_is_not_a_matrix_and_a_model_with_none_to_give_it() -> None:
    with pytest.raises(ValueError, match=r"got shapes \[\(4,\)\]"):
        Muon([nn.Parameter(torch.zeros(4))])
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 10))  # its one matrix is the head
    with pytest.raises(UsageError, match="optimizer muon updates weight matrices, and this model trains none but"):
        build_optimizer(model, OptimizerSettings(optimizer="muon"), lr=1e-3)
    build_optimizer(model, OptimizerSettings(optimizer="muon", muon_params="matrices"), lr=1e-3)


@pytest.mark.parametrize("name", ["adamw", "muon", "sgd"])
def test_a_checkpointed_optimizer_resumes_exactly(name: str) -> None:
    torch.manual_seed(0)
    settings = OptimizerSettings(optimizer=name)
    first = Classifier()
    optimizer = build_optimizer(first, settings, lr=1e-2)
    train(first, optimizer)
    second = copy.deepcopy(first)
    resumed = build_optimizer(second, settings, lr=1e-2)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    train(first, optimizer)
    train(second, resumed)
    for mine, other in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(mine, other)
