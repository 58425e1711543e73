"""The planner under tensor and pipeline parallelism: what each GPU holds, and the layouts it refuses."""

from __future__ import annotations

import pytest

from multigpu.core.errors import UsageError
from multigpu.planner import plan
from multigpu.planner.layout import bubble_fraction, micro_batches_in_flight, pipeline_stages
from multigpu.planner.shapes import BUILTIN, ModelShape

COMMON = {"gpus": 8, "gpu_memory": "80GB", "batch_size": 1, "seq_len": 2048, "precision": "bf16-mixed"}


def rows(**options: object) -> dict:
    return {m.strategy: m for m in plan("llama-3.1-8b", **COMMON, **options).strategies}


def test_tp_halves_the_split_matrices_and_keeps_norms_whole() -> None:
    t = BUILTIN["llama-3.1-8b"]
    one, two = rows(tp_size=1)["zero3"], rows(tp_size=2)["zero3"]
    # 4 bytes per fp32 weight over 8 data-parallel ranks (tp 1) or 4 (tp 2).
    linears = t.layers * sum(i * o for i, o in t.linears().values())
    norms = t.layers * 2 * t.hidden + t.hidden
    embeddings = 2 * t.vocab * t.hidden
    assert one.params == pytest.approx(4 * (linears + norms + embeddings) / 8)
    assert two.params == pytest.approx(4 * (linears / 2 + norms + embeddings / 2) / 4)


def test_tp_divides_the_split_activations_only() -> None:
    one, two = rows(tp_size=1)["zero3"].activations, rows(tp_size=2)["zero3"].activations
    assert one / 2 < two < one  # attention and MLP halve; norms, residual stream and log-softmax stay whole


def test_sequence_parallelism_divides_the_norms_and_layer_inputs_by_tp() -> None:
    from multigpu.planner.activations import transformer_parts

    t = BUILTIN["llama-3.1-8b"]
    whole = transformer_parts(t, 1, 2048, "bf16-mixed", tp=8)
    split = transformer_parts(t, 1, 2048, "bf16-mixed", tp=8, sequence_parallel=True)
    tokens, norms = 2048, 2 * 2048 * t.hidden * (4 + 4) + 8 * 2048  # two RMSNorms: fp32 input and output, rsqrt
    assert whole.layer - split.layer == norms - norms // 8
    assert split.layer_input == whole.layer_input // 8 == tokens * t.hidden * 4 // 8  # the fp32 residual stream
    assert whole.outside - split.outside == (tokens * t.hidden * 8 + 4 * tokens) * 7 // 8  # the final norm
    checkpointed = {"tp_size": 8, "activation_checkpointing": "full"}  # tp takes all 8 GPUs: the row is tp's
    assert rows(**checkpointed, sequence_parallel=True)["tp"].activations < rows(**checkpointed)["tp"].activations


def test_pp_puts_half_the_layers_on_each_rank() -> None:
    stages = pipeline_stages(32, 2, 1, "1f1b", 2)
    assert [s.layers for s in stages] == [16, 16]
    assert (stages[0].first, stages[0].last, stages[1].first, stages[1].last) == (True, False, False, True)
    interleaved = pipeline_stages(31, 2, 2, "interleaved", 4)
    assert [s.layers for s in interleaved] == [16, 15]  # stages of 8, 8, 8, 7: rank 0 holds the first and third


def test_the_pipeline_rank_that_binds_is_reported() -> None:
    whole = rows()["zero3"]
    piped = rows(pp_size=2, microbatches=1)["zero3"]
    assert piped.params == pytest.approx(whole.params * 2 / 2, rel=0.1)  # half the layers, twice the shard
    assert piped.pp_rank == 1  # the last rank: its head and log-softmax outweigh the first's embedding


def test_gpipe_holds_more_activations_than_1f1b() -> None:
    options = {"pp_size": 4, "microbatches": 8, "gpus": 4}
    gpipe = plan("llama-3.1-8b", **{**COMMON, **options}, pp_schedule="gpipe").strategies[0]
    one_f = plan("llama-3.1-8b", **{**COMMON, **options}, pp_schedule="1f1b").strategies[0]
    assert gpipe.strategy == one_f.strategy == "pp"
    assert gpipe.activations > one_f.activations
    assert micro_batches_in_flight("gpipe", 4, 0, 1, 8) == 8
    assert [micro_batches_in_flight("1f1b", 4, r, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    # Interleaved on the first rank: pp + (pp - 1) / v micro-batches of its whole layers.
    assert micro_batches_in_flight("interleaved", 4, 0, 2, 8) == 4 + 3 / 2


def test_rows_are_the_strategies_that_compose() -> None:
    assert list(plan("llama-3.1-8b", gpus=8, nodes=2, tp_size=2).strategies[i].strategy for i in range(3)) == [
        "zero2",
        "hsdp",
        "zero3",
    ]
    assert [m.strategy for m in plan("llama-3.1-8b", gpus=8, tp_size=8).strategies] == ["tp"]
    assert [m.strategy for m in plan("llama-3.1-8b", gpus=8, tp_size=4, pp_size=2).strategies] == ["tp+pp"]


def test_without_tp_or_pp_nothing_changes() -> None:
    assert rows(tp_size=1, pp_size=1) == rows()
    assert [m.strategy for m in plan("llama-3.1-8b", gpus=8).strategies][:5] == [
        "ddp",
        "zero1",
        "zero2",
        "zero3",
        "zero3+offload",
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"gpus": 8, "tp_size": 3},
            "--tp-size 3 x --pp-size 1 does not divide the 8 GPUs (--gpus x --nodes); choose degrees whose "
            "product divides 8.",
        ),
        (
            {"gpus": 8, "pp_size": 2, "pp_stages_per_rank": 2},
            "pp_stages_per_rank 2 does not fit pp_schedule 1f1b: interleaved takes 2 or more stages per rank, "
            "gpipe and 1f1b take 1; set them together.",
        ),
        (
            {"gpus": 8, "pp_schedule": "zigzag"},
            "Unknown pp_schedule 'zigzag'; choose one of gpipe, 1f1b, interleaved.",
        ),
        ({"gpus": 8, "microbatches": 0}, "microbatches must be 1 or more (got 0)."),
        (
            {"gpus": 8, "sequence_parallel": True},
            "--sequence-parallel splits the sequence over the tp GPUs; add --tp-size or drop it.",
        ),
    ],
)
def test_bad_layouts_are_one_sentence(options: dict, message: str) -> None:
    with pytest.raises(UsageError) as error:
        plan("llama-3.1-8b", **options)
    assert str(error.value) == message


def test_a_layout_the_model_cannot_take_is_refused() -> None:
    with pytest.raises(UsageError, match=r"^--tp-size 16 does not divide the model's 8 key/value heads; choose"):
        plan("llama-3.1-8b", gpus=16, tp_size=16)
    with pytest.raises(UsageError, match=r"makes 64 pipeline stages for the model's 32 layers"):
        plan("llama-3.1-8b", gpus=8, nodes=8, pp_size=64)


def test_bubble_fraction() -> None:
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 4, 2) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 8) == 0.0


def test_each_planner_row_lays_processes_out_as_its_strategy_does() -> None:
    """The planner (below the strategies) names each row's spread itself; it must be the registered strategy's."""
    from multigpu.planner.config import SPREADS
    from multigpu.strategies import strategy_class

    def strategy_of(row: str) -> str:
        return {"tp+pp": "pp", "zero3+offload": "zero3"}.get(row, "deepspeed" if "deepspeed" in row else row)

    assert {row: SPREADS[row] for row in SPREADS} == {row: strategy_class(strategy_of(row)).spread for row in SPREADS}


def test_pp_split_sizes_each_stage_and_the_binding_rank_is_shown() -> None:
    """pp_split's counts are the stages' layers: 16,16 is the even split itself; 4,28 puts seven eighths of the
    layers on the last rank, whose memory then binds."""
    settings = {"gpus": 2, "pp_size": 2, "batch_size": 1, "seq_len": 2048}
    (even,) = plan("llama-3.1-8b", **settings).strategies
    (same,) = plan("llama-3.1-8b", **settings, pp_split="16,16").strategies
    (heavy,) = plan("llama-3.1-8b", **settings, pp_split="4,28").strategies
    assert same.total == even.total and (even.pp_rank, heavy.pp_rank) == (0, 1)
    assert heavy.total > 1.4 * even.total
    with pytest.raises(UsageError, match=r"^pp_split 4,20 names 2 stages of 24 layers in all, but .* give 2 counts"):
        plan("llama-3.1-8b", **settings, pp_split="4,20")
    with pytest.raises(UsageError, match=r"^pp_split 1,1 counts the model's layers, .*; add --layers\.$"):
        plan(ModelShape(params=7_000_000_000), gpus=2, pp_size=2, pp_split="1,1")
