"""The simulator on mixtures of experts: compute from the active parameters, expert parallelism's all-to-alls (how
they grow with ep, tokens and recomputation), the experts' data-parallel traffic it cuts, and the requests it
refuses. Arithmetic only, no processes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from multigpu.cli import main
from multigpu.planner.expert_cost import ep_comm
from multigpu.planner.links import INTERCONNECTS, Link, all_to_all, per_op
from multigpu.planner.shapes import BUILTIN, load_shape
from multigpu.planner.simulate import SimulateConfig, flops_per_token, simulate
from multigpu.tools.simulate_request import SimulateRequest, resolve

QWEN = {"model": "qwen3-30b-a3b", "tflops": 989.0, "strategy": "zero3", "gpus": "8", "batch_size": 2}
NO_LATENCY = per_op(Link(0.0, 360e9))  # all-to-all time is then bytes alone: (ep - 1) / ep x size / bandwidth


def config(**changes: object) -> SimulateConfig:
    return resolve(SimulateRequest(**{**QWEN, **changes}))[0]


def test_compute_counts_the_active_parameters() -> None:
    """6 x the 3.35B parameters a token is routed through, not the 30.5B stored, plus attention's 12 x layers x
    heads x head_dim (4096, not the 2048 hidden) x sequence."""
    shape = load_shape("qwen3-30b-a3b")
    assert flops_per_token(shape, 2048) == 6 * shape.active + 12 * 48 * 4096 * 2048
    assert flops_per_token(shape, 2048) < 6 * shape.params / 5


def test_all_to_all_grows_with_the_share_sent_away_and_with_tokens() -> None:
    """Per mixture layer 2 all-to-alls forward and 2 backward, each tokens x top-k x hidden x 2 bytes, of which a
    rank keeps 1/ep."""
    two = ep_comm(config(ep_size=2), NO_LATENCY, NO_LATENCY)[0]
    size = 2 * 2048 * 8 * 2048 * 2  # batch 2 x 2048 tokens, top-8 copies, bf16 rows of 2048
    assert two == pytest.approx(4 * 48 * size / 2 / 360e9)
    for ep in (4, 8):
        assert ep_comm(config(ep_size=ep), NO_LATENCY, NO_LATENCY)[0] == pytest.approx(two * (ep - 1) / ep * 2)
    longer = ep_comm(config(ep_size=2, seq_len=4096), NO_LATENCY, NO_LATENCY)[0]
    assert longer == pytest.approx(2 * two)
    again = ep_comm(config(ep_size=2, activation_checkpointing="full"), NO_LATENCY, NO_LATENCY)[0]
    assert again == pytest.approx(1.5 * two)  # the forward's two run again
    assert ep_comm(config(), NO_LATENCY, NO_LATENCY) == (0.0, 0.0)


def test_an_ep_group_past_a_node_shares_the_node_s_nics() -> None:
    ib = INTERCONNECTS["infiniband"]
    inside = config(ep_size=8, gpus="16")
    across = dataclasses.replace(inside, ep_size=16)
    links = per_op(INTERCONNECTS["nvlink"]), per_op(ib)
    size = 2 * 2048 * 8 * 2048 * 2
    expected = 4 * 48 * all_to_all(16, size, Link(ib.alpha_s, ib.bandwidth_Bps / 8))
    assert ep_comm(across, *links)[0] == pytest.approx(expected)
    # 46 GB/s, one NIC per GPU, against NVLink's 360 GB/s: about 8 times slower for about as many bytes.
    assert ep_comm(across, *links)[0] > 7 * ep_comm(inside, *links)[0]


def test_the_step_adds_the_all_to_alls_exposed_and_cuts_the_experts_gathers() -> None:
    """zero3 gathers 1/ep of the experts over 8 / ep ranks (none at ep 8), so the step's other traffic falls as the
    all-to-alls grow; those the simulator cannot hide."""
    (plain,) = simulate(config())
    assert plain.all_to_all_s == 0.0
    previous = plain
    for ep in (2, 4, 8):
        (split,) = simulate(config(ep_size=ep))
        assert split.compute_s == plain.compute_s
        assert split.all_to_all_s > previous.all_to_all_s
        assert split.comm_s - split.all_to_all_s < previous.comm_s - previous.all_to_all_s
        assert split.exposed_comm_s >= split.all_to_all_s
        previous = split


def test_ep_of_one_on_a_mixture_is_the_plain_data_parallel_path() -> None:
    assert simulate(config(ep_size=1)) == simulate(dataclasses.replace(config(), ep_size=1))
    (p,) = simulate(config(strategy="ddp"))
    assert p.all_to_all_s == 0.0


def test_the_default_gpu_counts_keep_those_ep_divides(capsys: pytest.CaptureFixture) -> None:
    request = SimulateRequest(**{**QWEN, "gpus": SimulateRequest.gpus, "ep_size": 4})
    assert resolve(request)[0].gpus == (4, 8, 16, 32, 64, 128)
    assert (
        main(["simulate", "--model", "qwen3-30b-a3b", "--tflops", "989", "--strategy", "zero3", "--ep-size", "8"]) == 0
    )
    out = capsys.readouterr().out
    assert "ep 8 (128 experts, 8 per token)" in out and "all-to-all s" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model", "qwen3-30b-a3b", "--ep-size", "3", "--gpus", "6"],
            "--ep-size 3 does not divide the model's 128 experts per layer; choose an ep size that divides 128.",
        ),
        (
            ["--model", "llama-3.1-8b", "--ep-size", "2", "--gpus", "8"],
            "--ep-size 2 splits a mixture's experts, so it needs a mixture-of-experts model's experts, top-k and "
            "width: give --model with one.",
        ),
        (
            ["--model", "qwen3-30b-a3b", "--ep-size", "16", "--gpus", "8"],
            "ep_size 16 spreads experts over the 8 data-parallel processes (shard 8) and does not divide them; "
            "choose an ep_size that divides 8.",
        ),
    ],
)
def test_a_bad_ep_is_one_sentence_and_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--tflops", "989", "--strategy", "zero3", *args])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"multigpu: error: {message}"


def test_powersgd_sees_the_experts_weights() -> None:
    """PowerSGD factors each matrix: the experts' 3-D weights and the router count among the model's."""
    from multigpu.tools.simulate_request import gradient_shapes

    t = BUILTIN["qwen3-30b-a3b"]
    total = sum(math.prod(shape) for shape in gradient_shapes(t))
    assert total == t.total_params() - 48 * t.qk_norm  # the q/k norms aside
