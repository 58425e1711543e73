"""The planner under tensor and pipeline parallelism: what each GPU holds, and the layouts it refuses."""

from __future__ import annotations

import pytest

from multigpu.core.errors import UsageError
from multigpu.planner import plan
from multigpu.planner.model_parallel import bubble_fraction, micro_batches_in_flight, pipeline_stages
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
            "pp_stages_per_rank 2 does not fit pp_schedule 1f1b: interleaved and interleaved-zb take 2 or more "
            "stages per rank, gpipe and 1f1b take 1 (zbv and dualpipev set 2 themselves); set them together.",
        ),
        (
            {"gpus": 8, "pp_schedule": "zigzag"},
            "Unknown pp_schedule 'zigzag'; choose one of gpipe, 1f1b, interleaved, interleaved-zb, zbv, dualpipev.",
        ),
        ({"gpus": 8, "microbatches": 0}, "microbatches must be 1 or more (got 0)."),
        (
            {"gpus": 8, "pp_size": 2, "pp_schedule": "dualpipev", "microbatches": 2},
            "pp_schedule dualpipev runs at least one micro-batch per stage, so pp_microbatches 2 is too few for its "
            "4 stages (2 x pp_size 2); give 4 or more.",
        ),
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
    assert bubble_fraction(4, 4, 2, "interleaved") == pytest.approx(3 / 11)
    assert bubble_fraction(1, 8) == 0.0
    # zbv with 2 pp micro-batches idles pp - 1 forwards of a stage beside its 3 x 2 x m: 3 / 51 on 4 ranks.
    assert bubble_fraction(4, 8, 2, "zbv") == pytest.approx(3 / 51)


def torch_order(name: str, pp: int, m: int, v: int = 2) -> dict:
    """torch's own per-rank compute order for `name` (its schedule class's arithmetic, without any process)."""
    from torch.distributed.pipelining import schedules

    cls = {
        "zbv": schedules.ScheduleZBVZeroBubble,
        "dualpipev": schedules.ScheduleDualPipeV,
        "interleaved-zb": schedules.ScheduleInterleavedZeroBubble,
        "interleaved": schedules.ScheduleInterleaved1F1B,
    }[name]
    schedule = object.__new__(cls)
    schedule.pp_group_size, schedule._n_microbatches, schedule.n_local_stages = pp, m, v
    schedule.num_stages = schedule._num_stages = pp * v
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    order = {}
    for rank in range(pp):
        schedule.rank = rank
        order[rank] = schedule._calculate_single_rank_operations(rank)
    if name == "interleaved-zb":
        schedule.pipeline_order = order
        order = schedule._add_bubbles_to_actions(pp * v)
    return {rank: [a for a in actions if a is not None] for rank, actions in order.items()}


def run_order(order: dict, stages: int) -> tuple[float, list[int]]:
    """Runs every rank's order step by step, a forward, an input half and a weight half each 1 (a whole backward 2),
    each action when its rank is free and its inputs are there: (the step's length, each rank's peak of stage
    activations kept, from a forward to its backward's weight half)."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    cost = {C.FORWARD: 1, C.BACKWARD_INPUT: 1, C.BACKWARD_WEIGHT: 1, C.FULL_BACKWARD: 2}
    done: dict = {}
    position, free, live, peak = dict.fromkeys(order, 0), dict.fromkeys(order, 0.0), dict.fromkeys(order, 0), {}
    moved = True
    while moved:
        moved = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                parts = actions[position[rank]].sub_actions or (actions[position[rank]],)
                needs = []
                for a in parts:
                    s, mb, kind = a.stage_index, a.microbatch_index, a.computation_type
                    needs += [(s - 1, mb, "F")] if kind == C.FORWARD and s > 0 else []
                    if kind in (C.BACKWARD_INPUT, C.FULL_BACKWARD):
                        needs += [(s, mb, "F")] + ([(s + 1, mb, "B")] if s < stages - 1 else [])
                    needs += [(s, mb, "I")] if kind == C.BACKWARD_WEIGHT else []
                if any(need not in done for need in needs):
                    break
                time = max([free[rank], *(done[need] for need in needs)])
                for a in parts:
                    time += cost[a.computation_type]
                    kind = a.computation_type
                    key = "F" if kind == C.FORWARD else "I" if kind == C.BACKWARD_INPUT else "W"
                    done[(a.stage_index, a.microbatch_index, key)] = time
                    if kind in (C.BACKWARD_INPUT, C.FULL_BACKWARD):
                        done[(a.stage_index, a.microbatch_index, "B")] = time
                    live[rank] += 1 if kind == C.FORWARD else -1 if kind in (C.BACKWARD_WEIGHT, C.FULL_BACKWARD) else 0
                    peak[rank] = max(peak.get(rank, 0), live[rank])
                free[rank], position[rank], moved = time, position[rank] + 1, True
    assert all(position[rank] == len(actions) for rank, actions in order.items()), "the order deadlocked"
    return max(free.values()), [peak[rank] for rank in sorted(order)]


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "interleaved-zb"])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zero_bubble_bubbles_and_activations_are_torchs_orders_run_step_by_step(name: str, pp: int) -> None:
    """The planner's closed forms (bubble_fraction, micro_batches_in_flight) against torch's own orders run step by
    step, for every micro-batch count the schedule takes up to 3 x pp (and v = 2, 3 for interleaved-zb)."""
    for v in (2, 3) if name == "interleaved-zb" else (2,):
        for m in range(1, 3 * pp + 1):
            if (name == "dualpipev" and m < 2 * pp) or (name == "interleaved-zb" and m % max(1, m // pp)):
                continue
            length, peaks = run_order(torch_order(name, pp, m, v), pp * v)
            assert 1 - 3 * v * m / length == pytest.approx(bubble_fraction(pp, m, v, name)), (m, v)
            in_flight = [micro_batches_in_flight(name, pp, rank, v, m) * v for rank in range(pp)]
            assert peaks == pytest.approx(in_flight), (m, v)


def test_interleaved_activations_are_torchs_order_too() -> None:
    for pp, m in ((2, 4), (4, 8), (4, 4)):
        _, peaks = run_order(torch_order("interleaved", pp, m), 2 * pp)
        assert peaks == [micro_batches_in_flight("interleaved", pp, rank, 2, m) * 2 for rank in range(pp)]


def test_a_v_puts_the_head_beside_the_embedding_on_rank_0() -> None:
    stages = pipeline_stages(32, 4, 2, "zbv", 8)
    assert [(s.layers, s.first, s.last) for s in stages] == [(8, True, True)] + [(8, False, False)] * 3


def test_each_planner_row_lays_processes_out_as_its_strategy_does() -> None:
    """The planner's rows come from the registry (planner/rows.py): each lays processes out as its strategy does."""
    from multigpu.planner.rows import rows
    from multigpu.strategies import strategy_class

    def strategy_of(row: str) -> str:
        return {"tp+pp": "pp", "zero3+offload": "zero3"}.get(row, "deepspeed" if "deepspeed" in row else row)

    found = rows()
    assert set(found) == {
        *("single", "dp", "ddp", "zero1", "zero2", "zero3", "zero3+offload", "hsdp"),
        *("deepspeed1", "deepspeed2", "deepspeed3", "tp", "pp", "tp+pp"),
    }
    assert {label: r.spread for label, r in found.items()} == {
        label: strategy_class(strategy_of(label)).spread for label in found
    }


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
