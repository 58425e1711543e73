"""The simulator under context parallelism: Ulysses' all-to-alls, ring's overlapped exchanges, and the layouts and
sequences it refuses. Arithmetic only, no processes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from multigpu.core.errors import UsageError
from multigpu.planner.links import INTERCONNECTS, Link, all_reduce, all_to_all
from multigpu.planner.shapes import load_shape
from multigpu.planner.simulate import SimulateConfig, simulate
from multigpu.tools.simulate_request import SimulateRequest, resolve

LLAMA = {"model": "llama-3.1-8b", "tflops": 989.0, "strategy": "zero3", "gpus": "8"}


def config(**changes: object) -> SimulateConfig:
    request = SimulateRequest(**{**LLAMA, "seq_len": 65536, "cp_size": 8, **changes})
    return resolve(request)[0]


def step(c: SimulateConfig) -> tuple[float, float]:
    (p,) = simulate(c)
    return p.comm_s, p.exposed_comm_s


def test_cp_of_one_changes_nothing() -> None:
    plain = SimulateRequest(**{**LLAMA, "seq_len": 65536})
    assert simulate(resolve(plain)[0]) == simulate(config(cp_size=1))


def test_cp_divides_the_compute_over_its_ranks() -> None:
    one_gpu = dataclasses.replace(config(cp_size=1), gpus=(1,))
    (whole,) = simulate(one_gpu)
    (split,) = simulate(config())
    assert split.compute_s == pytest.approx(whole.compute_s / 8)
    assert split.throughput == pytest.approx(65536 / split.step_s)  # one replica: one sequence per step


def ulysses_comm(cp: int, seq: int, widths: tuple[int, ...], passes: int) -> float:
    """`passes` (forward, backward, forward again) of an all-to-all per width, per layer, on the node's link, and
    ddp's all-reduce of the one 4-byte gradient these configs hold."""
    link = INTERCONNECTS["nvlink"]
    once = sum(all_to_all(cp, seq / cp * width * 2, link) for width in widths)
    return passes * 32 * once + all_reduce(cp, 4, link)


def test_ulysses_costs_eight_all_to_alls_per_layer_on_the_node_link() -> None:
    """4 in forward (q, k, v, output) and 4 in backward, each (cp - 1) / cp of the rank's tokens x width: q and the
    output 4096 wide, k and v 1024 (8 key/value heads, which cp 8 divides). Full checkpointing adds the forward's."""
    c = dataclasses.replace(config(strategy="ddp"), params=1)
    assert step(c)[0] == pytest.approx(ulysses_comm(8, 65536, (4096, 1024, 1024, 4096), 2))
    full = dataclasses.replace(c, activation_checkpointing="full")
    assert step(full)[0] == pytest.approx(ulysses_comm(8, 65536, (4096, 1024, 1024, 4096), 3))
    assert step(c)[1] == step(c)[0]  # attention waits for its all-to-alls: nothing hides them


def test_repeated_key_value_heads_move_whole_width() -> None:
    """cp 16 does not divide Llama 8B's 8 key/value heads: k and v are repeated to the 32 query heads first, and
    move 4096 wide like q."""
    c = dataclasses.replace(config(cp_size=16, gpus="16", gpus_per_node=16), strategy="ddp", params=1)
    assert step(c)[0] == pytest.approx(ulysses_comm(16, 65536, (4096,) * 4, 2))


def test_the_all_to_all_is_a_ring_pass_of_each_ranks_share() -> None:
    link = Link(alpha_s=1e-5, bandwidth_Bps=1e9)
    assert all_to_all(4, 4e9, link) == pytest.approx(3 * 1e-5 + 3 / 4 * 4)
    assert all_to_all(1, 4e9, link) == 0.0


@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_cp_cost_grows_with_the_sequence(method: str) -> None:
    costs = [step(config(seq_len=seq, cp_method=method))[0] for seq in (8192, 32768, 131072)]
    assert costs[0] < costs[1] < costs[2]


def test_ring_hides_its_exchanges_under_long_attention() -> None:
    """A step's exchange moves the rank's k and v; a block's attention grows with the sequence squared, so at long
    sequences nothing is exposed, and at short ones on a slow link the exchange shows."""
    long_ring, long_ulysses = config(seq_len=262144, cp_method="ring"), config(seq_len=262144)
    ring_comm, ring_exposed = step(dataclasses.replace(long_ring, strategy="ddp", params=1))
    assert ring_exposed < 0.05 * ring_comm
    assert step(long_ring)[1] < step(long_ulysses)[1]  # Ulysses waits for every all-to-all
    slow = dataclasses.replace(config(seq_len=2048, cp_method="ring"), intra="pcie", strategy="ddp", params=1)
    comm, exposed = step(slow)
    assert 0 < exposed <= comm


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"gpus": (4, 12), "cp_size": 8},
            "--gpus 4,12 cannot be split into tp 1 x pp 1 x cp 8 groups; list multiples of 8.",
        ),
        ({"cp_size": 0}, "--cp-size must be 1 or more (got 0)."),
        ({"cp_method": "spiral"}, "--cp-method must be one of ulysses, ring (got 'spiral')."),
        ({"heads": 0}, "cp moves attention's heads, so it needs the model's heads: give --model."),
    ],
)
def test_bad_cp_configs_are_usage_errors(changes: dict, message: str) -> None:
    with pytest.raises(UsageError) as error:
        dataclasses.replace(config(), **changes)
    assert str(error.value) == message


def test_the_cli_refuses_a_bad_cp_layout_with_exit_2() -> None:
    from tests.dist import refusal

    args = ("simulate", "--model", "llama-3.1-8b", "--tflops", "989", "--cp-size", "8")
    printed = refusal(*args, "--seq-len", "1000")
    assert "--seq-len 1000 is not a multiple of 2 x --cp-size 8 = 16" in printed and printed.count("\n") == 1
    printed = refusal(*args, "--gpus", "12")
    assert "--gpus 12 cannot be split into tp 1 x pp 1 x cp 8 groups" in printed and printed.count("\n") == 1
    printed = refusal("simulate", "--params", "7e9", "--cp-size", "2", "--tflops", "989", "--gpus", "2")
    assert "give --model" in printed


def test_the_cli_takes_cp(capsys: pytest.CaptureFixture) -> None:
    from multigpu.cli import main

    args = ["simulate", "--model", "llama-3.1-8b", "--strategy", "zero3", "--cp-size", "8", "--tflops", "989"]
    assert main([*args, "--seq-len", "262144", "--json"]) == 0
    predictions = json.loads(capsys.readouterr().out)
    assert [p["gpus"] for p in predictions] == [8, 16, 32, 64, 128]  # the default list, kept to multiples of 8
    assert main([*args, "--seq-len", "262144", "--cp-method", "ring"]) == 0
    assert "cp 8 (ring)" in capsys.readouterr().out
    assert load_shape("llama-3.1-8b").transformer.kv_heads == 8
