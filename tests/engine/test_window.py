"""The accumulation window's weights: under context parallelism a summed loss is weighted by the data-parallel and
cp ranks together (their gradients are averaged together), and a mean loss is refused."""

from __future__ import annotations

import pytest
import torch

from multigpu.core.errors import UsageError
from multigpu.engine.window import Window


def test_a_summed_loss_is_weighted_by_the_data_parallel_and_cp_ranks() -> None:
    window = Window(1, data_world=2, device=torch.device("cpu"), wants_loss=False, cp=2)
    assert window.account(torch.tensor(3.0), count=5) == 4.0
    assert Window(1, 2, torch.device("cpu"), False).account(torch.tensor(3.0), count=5) == 2.0


def test_a_mean_loss_is_refused_under_context_parallelism() -> None:
    window = Window(1, data_world=1, device=torch.device("cpu"), wants_loss=False, cp=2)
    with pytest.raises(UsageError, match=r"so the loss must be their sum: return \(sum, count\)"):
        window.account(torch.tensor(3.0), count=None)


def test_a_global_batch_gives_the_accumulation_each_world_size_needs() -> None:
    from multigpu.engine.window import accumulation_for

    assert [accumulation_for(48, 4, world) for world in (1, 2, 3, 4, 6, 12)] == [12, 6, 4, 3, 2, 1]
    with pytest.raises(UsageError, match=r"^global_batch_size 48 is not a multiple of batch_size 4 x 5 .* = 20; "):
        accumulation_for(48, 4, 5)
    with pytest.raises(UsageError, match=r"= 64; choose a batch size"):
        accumulation_for(48, 32, 2)  # fewer samples than one pass of every rank
