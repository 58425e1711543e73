"""Compiled blocks: the Engine compiles each block once per shape, turns a shape that changes dynamic rather than
compiling for every length, and says when it compiled."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import multigpu as mg
from multigpu.transforms.compile import compile_blocks, compiled_graphs
from tests.transforms.test_recompute import Tiny


def test_a_changing_length_compiles_once_more_and_is_reported(capsys) -> None:
    torch._dynamo.reset()
    engine = mg.Engine(strategy="single", compile=True, activation_checkpointing="selective")
    model = Tiny().eval()  # dropout off: inductor draws its masks from another stream than eager
    reference = Tiny().eval()
    reference.load_state_dict(model.state_dict())
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for length in (6, 6, 5, 7, 9, 4):
        x = torch.randn(2, length, 16)
        engine.backward(model(x).square().mean())
        engine.step(optimizer)
        reference(x).square().mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    printed = capsys.readouterr().out
    assert "torch.compile: 2 graph(s) in the first step" in printed  # one forward and one backward, for 3 blocks
    assert printed.count("more graph(s)") == 1 and "in step 3" in printed  # then dynamic: 7, 9 and 4 reuse it
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        # Inductor fuses and reorders fp32 sums: measured within 1e-7 of eager after 6 steps; 1e-5 leaves room.
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_hugging_face_decoder_compiles_its_layers_once_not_once_per_layer() -> None:
    """Its key/value cache, filled in forward unless turned off, puts each layer's cache entry in the guards."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=12, num_attention_heads=4, vocab_size=64
    )
    model, before = transformers.LlamaForCausalLM(config), compiled_graphs()
    compile_blocks(model, model.model.layers, "aot_eager")
    ids = torch.randint(0, 64, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    # aot_eager counts the forward graph; 12 graphs, past dynamo's limit of 8, would raise.
    assert compiled_graphs() - before == 1
