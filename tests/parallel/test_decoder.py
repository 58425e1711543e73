"""A Hugging Face decoder's parts, found by the model's own pipeline plan: where the pipeline cuts it, and what
sequence parallelism splits by position; other models are refused in one sentence."""

from __future__ import annotations

import pytest
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from multigpu.core.errors import UsageError
from multigpu.parallel.decoder import decoder_plan
from multigpu.parallel.pipeline_stages import stage_parts
from multigpu.parallel.tensor_parallel import decoder_sequence_plan


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_the_stages_follow_the_models_pipeline_plan() -> None:
    model = tiny_llama()
    assert decoder_plan(model.model) == ("embed_tokens", "layers", "norm")
    names = [sorted(kept) for kept, _ in stage_parts(model, 2)]
    assert names == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.rotary_emb"],
        ["lm_head", "model.layers.2", "model.layers.3", "model.norm", "model.rotary_emb"],
    ]


def test_a_decoder_without_a_pipeline_plan_is_refused_with_one_sentence() -> None:
    model = tiny_llama()
    model.model.config.base_model_pp_plan = None
    with pytest.raises(UsageError, match=r"^LlamaModel has no pipeline plan \(base_model_pp_plan: .*\.$"):
        stage_parts(model, 2)


def test_sequence_parallelism_splits_the_first_layers_input_and_gathers_before_attention_and_mlp() -> None:
    plan = {name: type(style).__name__ for name, style in decoder_sequence_plan(tiny_llama()).items()}
    assert plan["model.layers.0"] == "_ToPositions"  # the embeddings stay whole for the mask and positions
    assert "model.layers.1" not in plan  # its input comes split already
    for index in range(4):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert plan[f"model.layers.{index}.{norm}"] == "SequenceParallel"
        assert plan[f"model.layers.{index}.self_attn"] == plan[f"model.layers.{index}.mlp"] == "_AllPositions"
    assert plan["model.norm"] == "SequenceParallel"
    assert len(plan) == 1 + 4 * 4 + 1


def test_sequence_parallelism_refuses_a_model_that_is_not_a_decoder() -> None:
    with pytest.raises(UsageError, match=r"^sequence_parallel splits a Hugging Face decoder's norms by position, "):
        decoder_sequence_plan(nn.Sequential(nn.Linear(2, 2)))
