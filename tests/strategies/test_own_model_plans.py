"""A model of one's own under tensor and pipeline parallelism by the plans it declares: a tp_plan whose norms are
`sequence_parallel` (Megatron's convention: the residual stream split by position between the split layers), and
`pp_layers` naming the layers a pipeline cuts between. Each lands on what one process computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist import run_in_processes

VOCAB, WIDTH, STEPS = 32, 16, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class OwnLM(nn.Module):
    """Not an nn.Sequential and not a Hugging Face model: its plans are all the strategies know of it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        self.tp_plan = {
            "embed": "embedding_rowwise",
            "blocks.*.norm": "sequence_parallel",
            "blocks.*.up": "colwise",
            "blocks.*.down": "rowwise",
            "norm": "sequence_parallel",
            "head": "colwise_gather_output",
        }
        self.pp_layers = ["embed", "blocks.*", "norm", "head"]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (STEPS, 4, 9), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]  # 8 positions: 4 per rank under sequence parallelism


def train(strategy: str | None, **settings: str) -> tuple[list[float], bool]:
    """Losses of STEPS AdamW steps (one process in plain torch for None; the Engine's `settings`), and whether the
    first block's norm weight lives on the tp mesh."""
    import multigpu as mg

    torch.manual_seed(0)
    model = OwnLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if strategy is None:
        losses = []
        for x, y in batches():
            loss = next_token_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, False
    engine = mg.Engine(strategy=strategy, seed=0, **settings)
    model, optimizer = engine.setup(model, optimizer)
    losses = []
    for x, y in batches():
        losses.append(engine.forward_backward(model, x, y, next_token_loss).item())
        engine.step(optimizer)
    norm = dict(model.named_parameters()).get("blocks.0.norm.weight")
    on_tp = norm is not None and "tp" in (getattr(getattr(norm, "device_mesh", None), "mesh_dim_names", None) or ())
    return losses, on_tp


# The layouts: tp; pp, its 5 listed layers cut 3 and 2 (as even as they go) and 1 and 4 (pp_split, for a second
# GPU faster than the first).
LAYOUTS = {"tp": ("tp", {}), "pp": ("pp", {}), "pp-split-1-4": ("pp", {"pp_split": "1,4"})}


def run_layouts() -> dict[str, tuple[list[float], bool]]:
    return {name: train(strategy, **settings) for name, (strategy, settings) in LAYOUTS.items()} | {"one": train(None)}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_in_processes("tests.strategies.test_own_model_plans:run_layouts", 2, timeout=180)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_own_model_lands_where_one_process_does(results: dict, layout: str) -> None:
    """fp32: the split sums and the micro-batches change only the order of additions (~1e-7 relative), while a
    norm gradient left unsummed over the positions' ranks, or a layer outside the pipeline, moves the loss by 1e-3
    or more within 3 steps at this learning rate."""
    losses, norm_on_tp = results[layout]
    reference, _ = results["one"]
    assert losses == pytest.approx(reference, rel=1e-5)
    assert reference[-1] < reference[0] - 0.01  # the steps changed the model
    assert norm_on_tp == (layout == "tp")  # sequence parallelism placed the norm on the mesh


def test_pp_split_cuts_the_listed_layers_where_it_says() -> None:
    from multigpu.parallel.pipeline_stages import stage_parts

    parts = stage_parts(OwnLM(), 2, "1,4")
    assert [list(kept) for kept, _ in parts] == [["embed"], ["blocks.0", "blocks.1", "norm", "head"]]


def test_pp_layers_that_name_no_module_are_refused_in_one_sentence() -> None:
    from multigpu.core.errors import UsageError
    from multigpu.parallel.pipeline_stages import stage_parts

    model = OwnLM()
    model.pp_layers = ["embed", "blocks.9", "head"]
    with pytest.raises(UsageError, match=r"^pp_layers names 'blocks.9', which matches no module of OwnLM; .*\.$"):
        stage_parts(model, 2)
    model.pp_layers = ["embed", "blocks.*", "norm", "head"]
    assert [list(kept) for kept, _ in stage_parts(model, 2)] == [["embed", "blocks.0", "blocks.1"], ["norm", "head"]]
