"""The chunked loss against the plain one: the same sums and gradients in one process, and under every strategy
and layout (the head split by vocabulary under tp, on the last stage under pp) the same training as one process's
plain loss; what cannot run is refused in one sentence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multigpu.core.errors import UsageError
from multigpu.transforms.loss import TokenLoss, check_runnable, linear_cross_entropy
from tests.dist import run_each_in_processes

VOCAB, WIDTH, ROWS, LENGTH, STEPS, PROMPT = 128, 32, 4, 16, 3, 3
CHUNK = 5  # tokens per chunk: divides none of the batches' 16 to 64 tokens, so every last chunk is short
# fp32, 1 process: chunked and plain differ only in the order of the sums over tokens (the loss, the head's
# gradient): measured 4e-7 relative at most here (the head's gradient), so 1e-6 leaves room, and any wrong term (a
# token counted twice, a gradient of the wrong sign or scale) is orders of magnitude past it.
SAME_PROCESS = 1e-6
# Each layout's losses against 1 process's plain ones over 3 SGD steps and a held-out batch: measured 2e-7 relative
# at most in fp32 (the split layers and the all-reduces add in other orders), while the vocabulary-split gradient
# without its all-reduce moved them by 9e-2. bf16-mixed: measured 1.4e-3 (FSDP's bf16 parameters against autocast);
# the bound is the recipe matrix's (tests/recipes/test_matrix.py).
TOLERANCE = {"32": 1e-5, "bf16-mixed": 2e-2}


def inputs(tokens: int = 301, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, WIDTH, generator=generator, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB, WIDTH, generator=generator, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, VOCAB, (tokens,), generator=generator)
    targets[::7] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, CHUNK, 64, 1000])
def test_chunked_sums_and_gradients_are_the_plain_ones(chunk: int) -> None:
    hidden, weight, targets = inputs()
    found = {}
    for mode in ("plain", "chunked"):
        loss, count = linear_cross_entropy(hidden, weight, targets, mode=mode, chunk_tokens=chunk)
        # Backward starts from 3 x the loss, as engine.backward scales a micro-batch's sum by its weight.
        found[mode] = (loss, count, *torch.autograd.grad(3 * loss, [hidden, weight]))
    assert found["chunked"][1] == found["plain"][1] == (targets != -100).sum() == 258
    for plain, chunked in zip(found["plain"], found["chunked"], strict=True):
        assert (chunked - plain).abs().max() <= SAME_PROCESS * plain.abs().max()


def test_chunked_computes_only_the_gradients_asked_for() -> None:
    hidden, weight, targets = inputs()
    frozen = weight.detach()  # a LoRA model's head: the hidden states' gradient only
    expected = torch.autograd.grad(linear_cross_entropy(hidden, frozen, targets, mode="plain")[0], hidden)[0]
    found = torch.autograd.grad(linear_cross_entropy(hidden, frozen, targets, chunk_tokens=CHUNK)[0], hidden)[0]
    assert (found - expected).abs().max() <= SAME_PROCESS * expected.abs().max()
    with torch.no_grad():
        loss, _ = linear_cross_entropy(hidden, weight, targets, chunk_tokens=CHUNK)
    assert not loss.requires_grad and loss.item() == pytest.approx(
        linear_cross_entropy(hidden, weight, targets, mode="plain")[0].item(), rel=SAME_PROCESS
    )


def test_bf16_autocast_gives_each_input_its_own_dtype() -> None:
    hidden, weight, targets = inputs()
    found = {}
    for mode in ("plain", "chunked"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = linear_cross_entropy(hidden, weight, targets, mode=mode, chunk_tokens=CHUNK)
        found[mode] = (loss, *torch.autograd.grad(loss, [hidden, weight]))
    assert [t.dtype for t in found["chunked"]] == [torch.float32] * 3
    for plain, chunked in zip(found["plain"], found["chunked"], strict=True):  # bf16 products, fp32 sums
        assert (chunked - plain).abs().max() <= 1e-2 * plain.abs().max()


def tiny_llama(tied: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def test_the_head_hands_its_input_through_only_inside_hidden_states() -> None:
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 8))
    loss = TokenLoss(model.lm_head, "chunked")
    with torch.no_grad(), loss.hidden_states():
        hidden = model(input_ids=ids).logits
    with torch.no_grad():
        assert torch.equal(hidden, model.model(input_ids=ids).last_hidden_state)
        assert model(input_ids=ids).logits.shape == (2, 8, VOCAB)  # generation after training sees logits
    assert "forward" not in model.lm_head.__dict__


REFUSALS = [
    ({"loss": "fused"}, "use loss chunked on CPU"),
    ({"loss": "plain", "liger": True}, "use loss chunked on CPU"),
    ({"loss": "fused", "device": torch.device("cuda"), "vocabulary_split": True}, "use loss chunked under tensor"),
    ({"loss": "chunked", "head_kept": False}, "use loss plain under strategy deepspeed"),  # its ZeRO-3
    ({"loss": "chunked", "find_unused_parameters": True}, "drop find_unused_parameters"),
]


@pytest.mark.parametrize(("settings", "words"), REFUSALS)
def test_what_cannot_run_is_refused_in_one_sentence(settings: dict, words: str) -> None:
    given = {"liger": False, "device": torch.device("cpu"), "head_kept": True, "vocabulary_split": False} | settings
    with pytest.raises(UsageError, match=words):
        check_runnable(**given)
    check_runnable("chunked", False, torch.device("cpu"), True, True)  # what runs on this machine


def test_a_head_with_a_bias_is_refused() -> None:
    with pytest.raises(UsageError, match="has a bias"):
        TokenLoss(nn.Linear(WIDTH, VOCAB), "chunked")


# -- every layout against one process ------------------------------------------------------------------------------
def sequential_model() -> nn.Module:
    """A model whose head is a top-level child: zero3 makes it a unit of its own, resharded after its forward."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB, False))


def batches() -> list[dict[str, torch.Tensor]]:
    """Rows whose every next token follows from the token before (learnt in a few steps, so that the losses move),
    with their first tokens left out of the loss, as a prompt's are."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS * (STEPS + 1), LENGTH), generator=generator)
    labels = (ids * 3 + 1) % VOCAB
    labels[:, :PROMPT] = -100
    return [{"input_ids": row, "labels": label} for row, label in zip(ids, labels, strict=True)]


def train(strategy: str, loss: str, model: str = "llama", **settings: object) -> list[float]:
    """The loss per target token of each SGD step of global batch ROWS, then of a held-out batch, on every rank."""
    import multigpu as mg

    engine = mg.Engine(strategy=strategy, loss=loss, seed=0, **settings)
    built = tiny_llama() if model == "llama" else sequential_model()
    optimizer = torch.optim.SGD(built.parameters(), lr=2.0)
    built, optimizer = engine.setup(built, optimizer)
    whole = getattr(built, "module", built)  # under pp, the whole model: the last stage holds its head
    loss_fn = engine.lm_loss(whole.lm_head if model == "llama" else whole[3], chunk_tokens=CHUNK)
    data = batches()

    def wrap(ids: torch.Tensor) -> object:
        return {"input_ids": ids} if model == "llama" else ids

    losses = []
    # Each step's summed loss over every rank, counted once per replica (its tp and pp ranks hold the same).
    per_token = ROWS * (LENGTH - PROMPT) * engine.world_size // engine.data_parallel_size
    loader = engine.dataloader(data[: ROWS * STEPS], batch_size=ROWS // engine.data_parallel_size, shuffle=False)
    for batch in loader:
        summed = engine.forward_backward(built, wrap(batch["input_ids"]), batch["labels"], loss_fn)
        losses.append(engine.reduce(summed, "sum").item() / per_token)
        engine.step(optimizer)
    ids, labels = (torch.stack([row[key] for row in data[-ROWS:]]) for key in ("input_ids", "labels"))
    summed, count = engine.forward_loss(built, wrap(ids), labels, loss_fn)
    return [*losses, summed.item() / count.item()]


ONE = {
    "plain": ("single", "plain", {}),
    "chunked": ("single", "chunked", {}),
    "plain-bf16-mixed": ("single", "plain", {"precision": "bf16-mixed"}),
    "sequential-plain": ("single", "plain", {"model": "sequential"}),
}
# name -> (processes, strategy, settings): what each is held against is ONE's plain cell of its precision and model.
LAYOUTS = {
    "ddp": (2, "ddp", {}),
    "zero2": (2, "zero2", {}),
    "zero3": (2, "zero3", {}),
    "zero3-bf16-mixed": (2, "zero3", {"precision": "bf16-mixed"}),
    "zero3-head-unit": (2, "zero3", {"model": "sequential"}),
    "tp": (2, "tp", {}),
    "tp-sequence-parallel": (2, "tp", {"sequence_parallel": True}),
    "pp": (2, "pp", {"pp_schedule": "gpipe"}),
    "hsdp-2x2": (4, "hsdp", {"replicate": 2}),
    "zero3-x-tp": (4, "zero3", {"tp_size": 2}),
    "pp-x-tp": (4, "pp", {"tp_size": 2}),
}


@pytest.fixture(scope="module")
def trained() -> dict[str, list[float]]:
    return train_every_cell()


def train_every_cell() -> dict[str, list[float]]:
    """Every cell, in one launch per process count; rank 0's losses (every rank returns the same)."""
    found = {}
    for nproc, cells in [(1, {name: (1, *cell) for name, cell in ONE.items()}), *_by_processes()]:
        calls = [{"strategy": strategy, "loss": loss, **settings} for _, strategy, loss, settings in cells.values()]
        results = run_each_in_processes("tests.transforms.test_loss:train", nproc, calls, timeout=300)
        assert all(rank == results[0] for rank in results), f"the ranks disagree: {results}"
        found.update(zip(cells, results[0], strict=True))
    return found


def _by_processes() -> list[tuple[int, dict]]:
    groups: dict[int, dict] = {}
    for name, (nproc, strategy, settings) in LAYOUTS.items():
        groups.setdefault(nproc, {})[name] = (nproc, strategy, "chunked", settings)
    return sorted(groups.items())


def test_chunked_trains_as_plain_in_one_process(trained: dict[str, list[float]]) -> None:
    assert trained["chunked"] == pytest.approx(trained["plain"], rel=SAME_PROCESS)
    assert trained["plain"][STEPS - 1] < trained["plain"][0] - 0.3  # it learns: the comparisons below are not of noise


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_under_each_layout_trains_as_one_process(trained: dict[str, list[float]], layout: str) -> None:
    settings = LAYOUTS[layout][2]
    precision = settings.get("precision", "32")
    reference = (
        ("sequential-" if settings.get("model") else "") + "plain" + ("-bf16-mixed" if precision != "32" else "")
    )
    assert trained[layout] == pytest.approx(trained[reference], rel=TOLERANCE[precision])
