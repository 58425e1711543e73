"""The planner on mixtures of experts: parameter counts read from Hugging Face configs (checked against the models
transformers builds), what ep divides and what it leaves alone, the plan command's ep rows and refusals, and the ep
`auto` picks. Pure arithmetic, but for the tiny models built to count their parameters."""

from __future__ import annotations

import re

import pytest

from multigpu.cli import main
from multigpu.core.errors import UsageError
from multigpu.planner import ModelShape, choose_strategy, plan
from multigpu.planner.activations import transformer_parts
from multigpu.planner.module_shape import from_module
from multigpu.planner.shapes import BUILTIN, from_config, load_shape

GIB = 2**30
QWEN = BUILTIN["qwen3-30b-a3b"]
EIGHT = {"gpus": 8, "gpu_memory": "80GB"}
# Fits zero3 at every ep and zero2 only with its experts split 8 ways (see test_the_recommendation_takes_...).
SHORT = {**EIGHT, "batch_size": 2, "activation_checkpointing": "full"}


def test_qwen3_30b_a3b_counts_its_published_totals() -> None:
    """Qwen3's model card: 30.5B parameters, 3.3B activated. Per layer: q (2048 x 4096) and o, k and v (2048 x 512),
    128 experts of 3 x 2048 x 768, a 128 x 2048 router, two norms and the 128-wide q and k norms; untied embeddings
    of 151936 x 2048 and the final norm."""
    attention = 2 * 2048 * 4096 + 2 * 2048 * 512
    expert = 3 * 2048 * 768
    norms = 2 * 2048 + 2 * 128
    outside = 2 * 151936 * 2048 + 2048
    shape = load_shape("qwen3-30b-a3b")
    assert shape.params == 48 * (attention + 128 * expert + 128 * 2048 + norms) + outside
    assert shape.active == 48 * (attention + 8 * expert + 128 * 2048 + norms) + outside
    assert shape.expert_params == 48 * 128 * expert
    assert shape.params == pytest.approx(30.5e9, rel=0.01)
    # 3.353B: the card's 3.3B drops the last digit (3.35 would round up), so the bound is 2%, not 1%.
    assert shape.active == pytest.approx(3.3e9, rel=0.02)


def hf_configs() -> list:
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    small = {"vocab_size": 500, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}
    return [
        # head_dim 32 x 4 heads is not 64; layer 1 dense by decoder_sparse_step 2, layer 2 by mlp_only_layers.
        Qwen3MoeConfig(
            **small,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),
        MixtralConfig(**small, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        OlmoeConfig(**small, num_hidden_layers=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
    ]


def test_configs_count_what_transformers_builds() -> None:
    """Every parameter, and the experts apart, exactly, for Qwen3-MoE (mixed dense and mixture layers, an explicit
    head_dim, q/k norms over a head), Mixtral and OLMoE (q/k norms over the whole width); from_module finds the same
    experts in the built model."""
    from transformers import AutoModelForCausalLM

    for config in hf_configs():
        model = AutoModelForCausalLM.from_config(config)
        experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        shape = from_config(config.to_dict(), config.model_type)
        assert (shape.params, shape.expert_params) == (sum(p.numel() for p in model.parameters()), experts)
        built = from_module(model)
        assert (built.expert_params, built.experts) == (experts, shape.experts)
    assert from_config(hf_configs()[0].to_dict(), "qwen").transformer.moe_layers == 1  # layers 1 and 3 dense


def test_a_deepseek_config_is_refused_rather_than_miscounted() -> None:
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96}
    with pytest.raises(UsageError, match=r"^deepseek is a DeepSeek-style mixture .* instead\.$"):
        from_config({**config, "vocab_size": 100, "n_routed_experts": 8}, "deepseek")


def rows(**options: object) -> list:
    return plan("qwen3-30b-a3b", **{**SHORT, **options}).strategies


def test_ep_splits_what_a_rank_holds_whole_but_not_the_shards() -> None:
    """zero3 shards the experts over all 8 ranks at any ep (1/ep of them, over 8/ep ranks each), so its model states
    stay put; what ep shrinks is what is held whole: zero3's two gathered layers (down to the embedding, the largest
    unit from ep 4 on), zero2's gathered weights, ddp's copy of the experts; zero1 takes no ep."""
    zero3 = {m.ep_size: m for m in rows() if m.strategy == "zero3"}
    assert sorted(zero3) == [1, 2, 4, 8]
    for ep in (2, 4, 8):
        states = ("params", "grads", "optimizer", "activations")
        assert [getattr(zero3[ep], part) for part in states] == [getattr(zero3[1], part) for part in states]
    assert zero3[1].total > zero3[2].total > zero3[4].total == zero3[8].total
    assert zero3[1].temporary == 2 * QWEN.moe_layer_params() * 2  # two bf16 layers of 128 experts
    assert zero3[8].temporary == 2 * QWEN.vocab * QWEN.hidden * 2
    held = QWEN.total_params() - QWEN.expert_params() * 7 / 8  # the dense part and 1/8 of the experts
    one, eight = ({m.strategy: m for m in rows(ep_size=ep)} for ep in (1, 8))
    assert eight["ddp"].params == pytest.approx(held * 4)  # fp32 weights
    assert eight["zero2"].temporary == pytest.approx(held * 2)  # bf16 weights gathered from forward to backward
    assert eight["zero2"].params == one["zero2"].params
    for strategy in ("ddp", "zero2"):
        assert eight[strategy].total < 0.7 * one[strategy].total
    assert eight["zero1"].total == one["zero1"].total  # zero1 takes no ep (its optimizer partitions whole tensors)


def test_the_all_to_all_buffers_come_with_ep_and_grow_with_top_k() -> None:
    """A mixture layer keeps its routed tokens' rows (top-k copies of each token); ep adds the all-to-alls' send and
    receive buffers, 2 x tokens x top-k x hidden, one layer at a time."""
    one = transformer_parts(QWEN, 1, 2048, "bf16-mixed", moe=True)
    split = transformer_parts(QWEN, 1, 2048, "bf16-mixed", moe=True, ep=4)
    assert (one.ep_buffers, split.ep_buffers) == (0, 2 * 2048 * 8 * 2048 * 2)
    assert split.layer == one.layer
    fewer = transformer_parts(replace_top_k(4), 1, 2048, "bf16-mixed", moe=True)
    # 4 fewer copies of each token: its rows in and out and the expert MLP's four tensors.
    assert one.layer - fewer.layer == 2048 * 4 * 2 * (2 * 2048 + 4 * 768)


def replace_top_k(k: int):
    from dataclasses import replace

    return replace(QWEN, experts_per_token=k)


def test_lora_trains_the_projections_and_leaves_the_experts_whole() -> None:
    """Adapters on attention's four projections only (every layer a mixture, no shared expert); QLoRA quantises
    those linears and leaves the experts' 3-D weights in bf16."""
    lora = plan("qwen3-30b-a3b", **SHORT, lora_r=8)
    assert lora.trainable == 48 * 8 * sum(i + o for i, o in QWEN.attention_linears().values())
    qlora = next(m for m in plan("qwen3-30b-a3b", **SHORT, qlora=True).strategies if m.strategy == "ddp")
    assert qlora.params > QWEN.expert_params() * 2


def test_the_recommendation_takes_the_smallest_ep_its_strategy_fits() -> None:
    """ddp and zero1 fit at no ep; zero2 only with its experts split 8 ways (its gathered weights fall from 57 to
    10 GiB): the recommendation says so, and the table shows that row."""
    result = plan("qwen3-30b-a3b", **SHORT)
    assert (result.recommendation, result.ep_size) == ("zero2", 8)
    assert result.reason.startswith("zero2 needs ") and "with --ep-size 8; ddp, zero1 would not fit at any ep" in (
        result.reason
    )
    assert any(m.strategy == "zero2" and m.ep_size == 8 for m in result.strategies)
    asked = plan("qwen3-30b-a3b", **SHORT, ep_size=2)
    assert (asked.recommendation, asked.ep_size) == ("zero3", 2)  # an ep asked for is kept
    # auto leaves room for activations rather than counting them: zero2 fits at ep 4 (16 GiB of gathered weights
    # beside 57 GiB of shards), not at ep 2 (30 GiB).
    shape = load_shape("qwen3-30b-a3b")
    choice = choose_strategy(shape, "adamw", 8, 1, 80 * GIB, "bf16-mixed", offload_possible=False)
    assert (choice.strategy, choice.ep_size) == ("zero2", 4)
    dense = choose_strategy(ModelShape(params=10**8), "adamw", 8, 1, 80 * GIB, "bf16-mixed", offload_possible=False)
    assert (dense.strategy, dense.ep_size) == ("ddp", 1)


def test_plan_prints_zero3_at_every_ep(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    found = re.findall(r"^│\s+(\S+)\s+│\s+(\d+)\s+│", out, flags=re.MULTILINE)
    assert [ep for strategy, ep in found if strategy == "zero3"] == ["1", "2", "4", "8"]
    assert {"ddp", "zero1", "zero2", "zero3+offload"} <= {strategy for strategy, _ in found}
    assert "3.35B active in 128 experts" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model", "qwen3-30b-a3b", "--ep-size", "3", "--gpus", "6"],
            "--ep-size 3 does not divide qwen3-30b-a3b's 128 experts per layer; choose an ep size that divides 128.",
        ),
        (
            ["--model", "qwen3-30b-a3b", "--ep-size", "16", "--gpus", "8"],
            "ep_size 16 spreads experts over the 8 data-parallel processes (replicate 8) and does not divide them; "
            "choose an ep_size that divides 8.",
        ),
        (
            ["--model", "llama-3.1-8b", "--ep-size", "2", "--gpus", "8"],
            "--ep-size 2 spreads a mixture's experts, but llama-3.1-8b has none; drop --ep-size.",
        ),
    ],
)
def test_a_bad_ep_is_one_sentence_and_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"multigpu: error: {message}"
