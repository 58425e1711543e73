"""How the pipeline finds a Hugging Face decoder's parts: by the model's own pipeline plan, or a clear refusal."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from multigpu.core.errors import UsageError
from multigpu.strategies.pp import decoder_plan, stage_parts


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
