"""Tied weights and adapters under the sharding strategies and pipelines: a GPT-2-shaped model in nanoGPT's own layout
(its token embedding, an item of the `transformer` ModuleDict, shared with the output head) trains under zero2, zero3,
hsdp and pp to what one process computes, plain and with LoRA, and no unit splits a tie or holds an adapter alone."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from multigpu.core.errors import UsageError
from multigpu.transforms.modules import check_ties, default_units
from tests.dist import run_in_processes

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
STEPS, ROWS, LENGTH = 3, 4, 16
LORA_TARGETS = ["c_attn", "c_fc", "c_proj"]


def nanogpt() -> object:
    """docs/examples/nanogpt_model.py, the porting guide's model, imported by path."""
    if "nanogpt_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("nanogpt_model", EXAMPLES / "nanogpt_model.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["nanogpt_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["nanogpt_model"]


class Embeddings(nn.Module):
    """The token and position embeddings as one layer, so that a pipeline can cut the model into a chain."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


def build(lora: bool, pipeline: bool = False) -> nn.Module:
    """The same GPT on every rank and in every cell; `pipeline` adds the chain a pipeline cuts (the embeddings as one
    layer, still tied to the head across the stages)."""
    torch.manual_seed(0)
    model = nanogpt().GPT(nanogpt().GPTConfig(block_size=LENGTH, vocab_size=48, n_layer=2, n_head=2, n_embd=16))
    if pipeline:
        model.embed = Embeddings(model.transformer.wte, model.transformer.wpe)
        model.pp_layers = ["embed", "transformer.h.*", "transformer.ln_f", "lm_head"]
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        # In place (no PeftModel around it), so pp_layers' names still name the layers.
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS), model)
        for name, param in model.named_parameters():
            param.requires_grad = "lora_" in name
        with torch.no_grad():  # peft starts lora_B at zero: give the adapters a value that moves the loss at step 1
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.02)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 48, (STEPS * ROWS + ROWS, LENGTH + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def next_token_loss(output: tuple[torch.Tensor, None] | torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = output[0] if isinstance(output, tuple) else output
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_one_process(lora: bool) -> float:
    """Plain torch in one process over the same global batches: the validation loss after STEPS AdamW steps."""
    model = build(lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    x, y = data()
    for step in range(STEPS):
        rows = slice(step * ROWS, (step + 1) * ROWS)
        next_token_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return next_token_loss(model(x[-ROWS:]), y[-ROWS:]).item()


def train_cell(settings: dict, lora: bool) -> tuple[float, list[str]]:
    """The same run through the Engine: the validation loss on every rank, and the warnings FSDP gave."""
    import multigpu as mg

    engine = mg.Engine(seed=0, **settings)
    model = build(lora, pipeline=engine.strategy == "pp" or bool(settings.get("pp_size")))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = engine.setup(model, optimizer)
        x, y = data()
        dataset = torch.utils.data.TensorDataset(x[:-ROWS], y[:-ROWS])
        per_rank = ROWS // engine.data_parallel_size
        for inputs, targets in engine.dataloader(dataset, batch_size=per_rank, shuffle=False):
            engine.forward_backward(model, inputs, targets, next_token_loss)
            engine.step(optimizer)
        loss = engine.forward_loss(model, x[-ROWS:].to(engine.device), y[-ROWS:].to(engine.device), next_token_loss)
    said = [str(w.message) for w in caught if "FSDP" in str(w.message) or "view" in str(w.message)]
    return float(loss), said


CELLS = {
    2: {"zero2": {"strategy": "zero2"}, "zero3": {"strategy": "zero3"}, "pp": {"strategy": "pp"}},
    4: {
        "hsdp": {"strategy": "hsdp", "replicate": 2},
        "zero3-pp2": {"strategy": "zero3", "pp_size": 2},
        "pp4": {"strategy": "pp", "pp_size": 4},
    },
}


def run_cells(processes: int) -> dict:
    results = {"one": {lora: train_one_process(lora) for lora in (False, True)}}
    for name, settings in CELLS[processes].items():
        for lora in (False, True):
            results[(name, lora)] = train_cell(settings, lora)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def outcomes(request: pytest.FixtureRequest) -> tuple[int, dict]:
    nproc = request.param
    return nproc, run_in_processes("tests.strategies.test_tied_weights:run_cells", nproc, timeout=300, processes=nproc)


def test_tied_gpt_trains_to_one_process_loss(outcomes: tuple[int, dict]) -> None:
    """fp32 on tiny sizes: the split batch, the shards and the stages change only the order of additions (~1e-7
    relative); a tie broken between two copies (the head stepping apart from the embedding), or an adapter's
    gradient lost in its own unit, moves the validation loss by 1e-3 or more in 3 steps at this lr."""
    nproc, per_rank = outcomes
    for rank, results in enumerate(per_rank):
        for (name, lora), (loss, said) in ((k, v) for k, v in results.items() if k != "one"):
            reference = results["one"][lora]
            assert loss == pytest.approx(reference, rel=2e-5), (nproc, rank, name, lora)
            assert said == [], (name, lora, said)  # no view warning, no unit sharing a tied parameter
    untrained = train_untrained_loss()
    for lora in (False, True):
        assert abs(per_rank[0]["one"][lora] - untrained[lora]) > 5e-3  # the steps moved the loss far past the tolerance


def train_untrained_loss() -> dict[bool, float]:
    x, y = data()
    with torch.no_grad():
        return {lora: next_token_loss(build(lora)(x[-ROWS:]), y[-ROWS:]).item() for lora in (False, True)}


def test_units_leave_ties_whole_and_adapters_in_their_blocks() -> None:
    model = build(lora=True)
    names = {id(m): n for n, m in model.named_modules()}
    units = sorted(names[id(u)] for u in default_units(model))
    # wte shares its weight with lm_head (in the root), so it is no unit; wpe and ln_f are; dropout holds nothing.
    assert units == ["transformer.h.0", "transformer.h.1", "transformer.ln_f", "transformer.wpe"]


def test_units_that_split_a_tie_are_refused_in_one_sentence() -> None:
    model = build(lora=False)
    with pytest.raises(UsageError, match=r"^The unit 'transformer.wte' holds a parameter tied to a module outside"):
        check_ties(model, [model.transformer.wte, *model.transformer.h])
    with pytest.raises(UsageError, match=r"^The unit 'transformer' holds"):  # the dict holds the embedding alone
        check_ties(model, [model.transformer])
    check_ties(model, list(model.transformer.h))  # blocks without a tied parameter pass
