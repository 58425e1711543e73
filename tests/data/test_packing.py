"""Padding-free packing: which documents share a row, the rows themselves, and that training on them is training on
the documents one by one (the same loss and gradients), in one process and under ddp, zero3, tp (with and without
sequence parallelism) and pp on 2 processes, all in one launch."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest
import torch

from multigpu.data import packing
from multigpu.data.lm_data import collate
from multigpu.data.packing import PackedSamples, collate_packed, pack, packing_efficiency
from tests.dist import run_in_processes

# fp32 throughout. Packed and unpacked runs compute the same sums in other groupings: a masked-out key adds an
# exact 0 to a softmax, and the rest differs in the order of additions (matrix products over other row layouts,
# the all-reduce over ranks), ~1e-7 relative. A document that sees another moves its logits by ~1 (0.79 on the
# tiny Llama), a target lost or counted twice moves the loss by ~1/count: far outside 1e-5.
TOLERANCE = 1e-5
SEQ_LEN = 64


def realistic_lengths(count: int, seed: int = 0) -> list[int]:
    """Token counts of chat records: log-normal around 250 tokens with a long tail, cut to 8..2048 (instruction
    sets such as Alpaca's and ShareGPT's look like this under a Llama tokenizer)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(250), 0.8, count).astype(int), 8, 2048).tolist()


def test_pack_places_every_document_once_within_capacity_and_the_same_each_time() -> None:
    lengths = realistic_lengths(5000)
    bins = pack(lengths, 2048, window=512)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
    assert all(b == sorted(b) for b in bins)
    assert pack(lengths, 2048, window=512) == bins
    # Each window's bins come after the previous window's, so a stream packs a window at a time and a prefix of
    # the data packs into a prefix of the bins.
    firsts = [min(b) // 512 for b in bins]
    assert firsts == sorted(firsts) and all(max(b) // 512 == min(b) // 512 for b in bins)
    assert pack(lengths[:1024], 2048, window=512) == bins[: len(pack(lengths[:1024], 2048, window=512))]


def test_pack_fills_rows_that_padding_would_mostly_waste() -> None:
    lengths = realistic_lengths(20_000)
    started = time.perf_counter()
    bins = pack(lengths, 2048)
    seconds = time.perf_counter() - started
    # First-fit-decreasing leaves a few percent of each row empty; padding each record to 2048 leaves ~85%.
    assert packing_efficiency(lengths, bins, 2048) > 0.97
    assert np.mean(lengths) / 2048 < 0.2
    assert seconds < 5, f"packing 20,000 records took {seconds:.1f} s"


def test_pack_refuses_a_document_longer_than_a_row() -> None:
    with pytest.raises(ValueError, match="document 1 has 9 tokens; pack takes 1 to 8"):
        pack([3, 9, 2], 8)


def documents(lengths: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Random token documents as lm_data gives them: input_ids and labels (the next token), the first few labels
    of each -100 (a prompt)."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for n, length in enumerate(lengths):
        tokens = torch.randint(10, 2000, (length + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[: n % 4] = -100
        docs.append({"input_ids": tokens[:-1], "labels": labels})
    return docs


def test_packed_rows_restart_positions_and_never_target_across_documents() -> None:
    docs = documents([5, 3, 6, 2])
    samples = PackedSamples(docs, [[0, 1], [2], [3]])
    row = samples[0]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert torch.equal(row["input_ids"], torch.cat([docs[0]["input_ids"], docs[1]["input_ids"]]))
    # The last target of document 0 is its own next token, not document 1's first input.
    assert torch.equal(row["labels"][:5], docs[0]["labels"]) and torch.equal(row["labels"][5:], docs[1]["labels"])
    batch = collate_packed([samples[0], samples[2]], pad_id=7, multiple=4)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: it would hide the documents
    assert batch["input_ids"].shape == (2, 8)
    assert batch["position_ids"][1].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]  # the padding is a document of its own
    assert batch["input_ids"][1, 2:].eq(7).all() and batch["labels"][1, 2:].eq(-100).all()
    assert collate_packed([samples[1]], pad_id=0, multiple=4)["input_ids"].shape == (1, 8)


@pytest.fixture(scope="module")
def tiny() -> Any:
    from multigpu.models.lm_models import load_model

    return load_model("tiny", "full")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_gives_each_document_its_output_alone(tiny: Any, attention: str) -> None:
    """transformers builds the block-diagonal causal mask from position_ids when there is no attention_mask and no
    cache (packing.model_inputs turns the cache off: with one, the positions are ignored and documents mix)."""
    tiny.set_attn_implementation(attention)
    docs = documents([5, 9, 3, 7])
    batch = collate_packed(list(PackedSamples(docs, [[0, 1], [2, 3]])), pad_id=0, multiple=8)
    with torch.no_grad():
        packed = tiny(**packing.model_inputs(batch)).logits
        alone = [tiny(input_ids=d["input_ids"][None], use_cache=False).logits[0] for d in docs]
        cached = tiny(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    for (row, start), output in zip([(0, 0), (0, 5), (1, 0), (1, 3)], alone, strict=True):
        torch.testing.assert_close(packed[row, start : start + len(output)], output, rtol=TOLERANCE, atol=TOLERANCE)
    assert (cached[0, 5:14] - alone[1]).abs().max() > 0.1  # the test can tell mixed documents from separate ones


def test_flash_attention_gets_the_documents_of_every_row() -> None:
    """flash-attention (GPUs only) takes the documents as varlen sequences of the flattened batch; transformers
    infers them from position_ids for one row only, so they are passed for any number of rows, and not while
    generating (with a cache, queries and keys differ in length)."""
    from transformers import LlamaConfig

    from multigpu.models.lm_models import pass_document_bounds
    from multigpu.parallel.decoder import packed_attention_kwargs

    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    flash = LlamaConfig(num_hidden_layers=1)
    flash._attn_implementation = "flash_attention_2"
    bounds = packed_attention_kwargs(flash, positions)
    assert bounds["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 12] and bounds["max_length_q"] == 4
    flash._attn_implementation = "sdpa"
    assert packed_attention_kwargs(flash, positions) == {}
    flash._attn_implementation = "flash_attention_2"
    decoder = torch.nn.Module()
    decoder.config = flash
    _, generating = pass_document_bounds(decoder, (), {"position_ids": positions, "use_cache": True})
    assert "cu_seq_lens_q" not in generating


STAND_IN = "flash_varlen_stand_in"  # "flash" in its name: packed_attention_kwargs treats it as flash-attention


def varlen_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """flash-attention's varlen call on CPU: causal attention within each sequence that cu_seq_lens_q cuts the
    flattened batch into (a KeyError without them); query, key and value [batch, heads, positions, features]."""
    rows, heads, length, features = query.shape
    flat = [
        t.repeat_interleave(heads // t.shape[1], 1).transpose(1, 2).reshape(rows * length, heads, features)
        for t in (query, key, value)
    ]
    out = torch.empty_like(flat[0])
    bounds = kwargs["cu_seq_lens_q"].tolist()
    for start, end in itertools.pairwise(bounds):
        q, k, v = (t[start:end].transpose(0, 1) for t in flat)
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=kwargs.get("scaling")
        ).transpose(0, 1)
    return out.reshape(rows, length, heads, features), None


@pytest.mark.parametrize("runner", ["model", "pipeline stage"])
def test_varlen_attention_runs_each_document_alone(tiny: Any, runner: str) -> None:
    """The model (through load_model's hook) and a pipeline stage hand the documents' bounds to a flash-attention
    implementation: a stand-in for its varlen kernel gives each document its output alone."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    from multigpu.models.lm_models import pass_document_bounds
    from multigpu.parallel.pipeline_stages import stage_parts

    tiny.set_attn_implementation("sdpa")
    docs = documents([5, 9, 3, 7])
    batch = collate_packed(list(PackedSamples(docs, [[0, 1], [2, 3]])), pad_id=0, multiple=8)
    with torch.no_grad():
        alone = [tiny(input_ids=d["input_ids"][None], use_cache=False).logits[0] for d in docs]
    AttentionInterface.register(STAND_IN, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(STAND_IN, flash_attention_mask)
    tiny.config._attn_implementation = STAND_IN  # set_attn_implementation would look for a flash-attn kernel
    hook = tiny.get_decoder().register_forward_pre_hook(pass_document_bounds, with_kwargs=True)  # as load_model does
    try:
        run = tiny if runner == "model" else stage_parts(tiny, 1)[0][1](True, True)
        with torch.no_grad():
            output = run(**packing.model_inputs(batch))
    finally:
        hook.remove()
        tiny.set_attn_implementation("sdpa")
    packed = getattr(output, "logits", output)
    for (row, start), want in zip([(0, 0), (0, 5), (1, 0), (1, 3)], alone, strict=True):
        torch.testing.assert_close(packed[row, start : start + len(want)], want, rtol=TOLERANCE, atol=TOLERANCE)


# -- the done-when: packed and unpacked training give the same loss and gradients ---------------------------

LENGTHS = [5, 40, 17, 9, 33, 12, 25, 3, 48, 20, 11, 30, 7, 22, 15, 36]  # 16 records, 333 tokens
# name -> Engine settings; each runs packed and unpacked on 2 processes.
STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "zero3": {"strategy": "zero3"},
    "tp": {"strategy": "tp"},
    "tp-sequence-parallel": {"strategy": "tp", "sequence_parallel": True},
    "pp": {"strategy": "pp", "pp_microbatches": 2},
}


def rank_batches(data_rank: int, data_world: int, multiple: int) -> tuple[dict, dict]:
    """This data-parallel rank's share of the global batch, packed and unpacked: the bins data_rank,
    data_rank + data_world, ... and those bins' documents one a row, padded with an attention mask."""
    docs, bins = documents(LENGTHS), pack(LENGTHS, SEQ_LEN)
    mine = bins[data_rank::data_world]
    packed = collate_packed(list(PackedSamples(docs, mine)), pad_id=0, multiple=multiple)
    unpacked = collate([docs[i] for b in mine for i in b], pad_id=0, multiple=multiple)
    return packed, unpacked


def one_step(settings: dict, packed: bool) -> dict:
    """One forward and backward of the global batch under `settings`: the loss per target token over all ranks and
    every gradient, whole, by its name in the model, as the optimizer receives them (divided by the target count)."""
    import multigpu as mg
    from multigpu.models.lm_models import load_model
    from multigpu.recipes.finetune import summed_token_loss

    engine = mg.Engine(**settings, precision="32")
    model = load_model("tiny", "full")
    optimizer = GradientKeeper(model.parameters())
    model, optimizer = engine.setup(model, optimizer)
    batch = rank_batches(engine.data_parallel_rank, engine.data_parallel_size, engine.sequence_multiple)[not packed]
    inputs = packing.model_inputs(batch) if packed else {k: batch[k] for k in ("input_ids", "attention_mask")}
    loss = engine.forward_backward(model, inputs, batch["labels"], summed_token_loss)
    totals = engine.reduce(torch.stack([loss.double(), (batch["labels"] != -100).sum().double()]), op="sum")
    engine.step(optimizer)
    whole = getattr(model, "module", model)  # ddp's wrapper; pp's whole model, canonical names of tied weights
    names = {id(p): name for name, p in whole.named_parameters()}
    return {"loss": float(totals[0] / totals[1]), "grads": {names[i]: g for i, g in optimizer.kept.items()}}


class GradientKeeper(torch.optim.Optimizer):
    """Keeps each gradient, whole, at step time, and changes nothing."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        self.kept: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    self.kept[id(p)] = grad.detach().cpu().clone()


def reference() -> dict:
    """One process, no engine: each document run alone, its summed token loss; their sum over the target count."""
    from multigpu.models.lm_models import load_model
    from multigpu.transforms.loss import summed_cross_entropy

    model = load_model("tiny", "full")
    total, count = 0.0, 0
    for doc in documents(LENGTHS):
        logits = model(input_ids=doc["input_ids"][None], use_cache=False).logits
        loss, n = summed_cross_entropy(logits, doc["labels"][None])
        total, count = total + loss, count + int(n)
    (total / count).backward()
    return {"loss": float(total / count), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def strategies_both_ways(names: list[str]) -> dict:
    import os

    import torch.distributed as dist

    out = {"reference": reference()} if os.environ["RANK"] == "0" else {}  # before any Engine joins the group
    for name in names:
        for packed in (True, False):
            result = one_step(STRATEGIES[name], packed)
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result["grads"])  # pp: each rank holds its stages' gradients
            result["grads"] = {k: v for part in gathered for k, v in part.items()}
            out[(name, packed)] = result
    return out


@pytest.fixture(scope="module")
def two_processes() -> dict:
    return run_in_processes("tests.data.test_packing:strategies_both_ways", 2, timeout=240, names=list(STRATEGIES))[0]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_packed_training_gives_the_loss_and_gradients_of_unpacked(two_processes: dict, name: str) -> None:
    want = two_processes["reference"]
    for packed in (True, False):
        got = two_processes[(name, packed)]
        assert got["loss"] == pytest.approx(want["loss"], rel=TOLERANCE), f"{name} packed={packed}"
        assert got["grads"].keys() == want["grads"].keys()
        for key, grad in want["grads"].items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(
                got["grads"][key], grad, rtol=TOLERANCE, atol=TOLERANCE * scale, msg=f"{name} packed={packed} {key}"
            )


def test_one_process_packed_and_unpacked_give_the_reference() -> None:
    """The single strategy (one process, this one): packed and unpacked against each document run alone."""
    want = reference()
    for packed in (True, False):
        got = one_step({"strategy": "single"}, packed)
        assert got["loss"] == pytest.approx(want["loss"], rel=TOLERANCE), f"packed={packed}"
        for key, grad in want["grads"].items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(
                got["grads"][key], grad, rtol=TOLERANCE, atol=TOLERANCE * scale, msg=f"single packed={packed} {key}"
            )
