"""hsdp in the simulator, and the change `multigpu simulate` advises where the link between nodes is slow: arithmetic
only, no processes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from multigpu.planner.simulate import (
    INTERCONNECTS,
    Link,
    SimulateConfig,
    all_gather,
    all_reduce,
    reduce_scatter,
    simulate,
)
from multigpu.planner.simulate_advice import link_advice
from multigpu.tools.simulate_request import SimulateRequest, resolve

HYBRID = SimulateConfig(
    params=350_000_000, layers=24, compute_s=0.05, units_per_step=8, gpus=(16,), strategy="hsdp", overlap=False
)


def test_hsdp_shards_inside_a_node_and_all_reduces_a_shard_across_nodes() -> None:
    """Each unit: two gathers and a reduce-scatter over the node's 8 GPUs on NVLink, then the shard (1/8 of the
    unit's gradients) all-reduced over the 2 nodes, each of the node's 8 ranks on an eighth of its link."""
    intra, inter = INTERCONNECTS["nvlink"], INTERCONNECTS["ethernet"]
    (p,) = simulate(HYBRID, intra, inter)
    weights, grads = HYBRID.params * HYBRID.param_bytes / 24, HYBRID.params * HYBRID.grad_bytes / 24
    across = Link(inter.alpha_s, inter.bandwidth_Bps / 8)
    unit = 2 * all_gather(8, weights, intra) + reduce_scatter(8, grads, intra) + all_reduce(2, grads / 8, across)
    assert p.comm_s == pytest.approx(24 * unit)
    # Inside one node there are no replicas: hsdp is zero3 there.
    one_node = [dataclasses.replace(HYBRID, gpus=(8,), strategy=s) for s in ("hsdp", "zero3")]
    assert simulate(one_node[0])[0].step_s == simulate(one_node[1])[0].step_s


def test_hsdp_sends_a_node_the_bytes_of_one_all_reduce_where_ddp_rings_more() -> None:
    """On a bare link (no latency, 1 byte/s) and an instant one inside the node, the step's communication is the
    bytes each node sends: hsdp on 2 nodes x 2 GPUs sends the gradients once, as ddp on 2 x 1 does; ddp's flat ring
    over 2 x 2 sends them 1.5 times."""
    bare, instant = Link(0.0, 1.0), Link(0.0, 1e30)
    grads = 4e6 * 4

    def sent(strategy: str, gpus: int, per_node: int) -> float:
        c = SimulateConfig(4_000_000, 1.0, 1.0, layers=4, gpus=(gpus,), gpus_per_node=per_node, strategy=strategy)
        return simulate(dataclasses.replace(c, overlap=False), instant, bare)[0].comm_s

    assert sent("hsdp", 4, 2) == pytest.approx(grads)
    assert sent("ddp", 2, 1) == pytest.approx(grads)
    assert sent("ddp", 4, 2) == pytest.approx(1.5 * grads)


@pytest.mark.parametrize("strategy", ["zero3", "hsdp"])
def test_sharded_communication_exposed_is_never_more_than_all_of_it(strategy: str) -> None:
    """Two units and a link far slower than their compute: everything is exposed, and nothing twice."""
    c = dataclasses.replace(HYBRID, layers=2, gpus=(2, 16), gpus_per_node=8 if strategy == "hsdp" else 1)
    for overlap in (True, False):
        slow = Link(1e-4, 12.5e6)
        for p in simulate(dataclasses.replace(c, strategy=strategy, overlap=overlap), slow, slow):
            assert p.exposed_comm_s <= p.comm_s
            assert p.step_s == pytest.approx(p.compute_s + p.comm_s, rel=0.02)


def slow_link(tmp_path, bits_per_s: float) -> str:
    """A `bench --collectives` file across 2 nodes whose link carries `bits_per_s`, 100 us per hop."""
    link = Link(100e-6, bits_per_s / 8)
    rows = [
        {"op": op, "bytes": size, "time_s": hops * link.alpha_s + factor * size / link.bandwidth_Bps}
        for op, hops, factor in (("all_reduce", 2, 1.0), ("all_gather", 1, 0.5), ("reduce_scatter", 1, 0.5))
        for size in (4096, 65536, 2**20, 2**22)
    ]
    path = tmp_path / "inter.json"
    path.write_text(json.dumps({"backend": "nccl", "world_size": 2, "results": rows}))
    return str(path)


def request_over(link: str, **changes: object) -> SimulateRequest:
    """SmolLM2-135M, 70 ms a step on one device, across 2 nodes of 1 GPU each over `link`."""
    base = {"model": "smollm2-135m", "compute_s": 0.07, "units_per_step": 2, "gpus": "1,2", "gpus_per_node": 1}
    return SimulateRequest(**{**base, "inter_calibration": link, **changes})


def advice(request: SimulateRequest) -> str | None:
    config, intra, inter = resolve(request)
    return link_advice(request, simulate(config, intra, inter), lambda changed: simulate(*resolve(changed))[0])


def test_a_slow_link_is_told_what_to_change_fastest_first(tmp_path) -> None:
    text = advice(request_over(slow_link(tmp_path, 100e6)))
    assert text is not None and text.startswith("Communication holds up the step across nodes: at 2 GPUs on 2 nodes")
    assert text.index("--grad-compression powersgd") < text.index("--grad-compression bf16")
    assert "its factorisation's compute not counted" in text
    assert "hsdp" not in text  # one GPU per node: nothing to shard inside it
    # The figures are the simulator's own: bf16's step is the same request's with bf16 gradients.
    config, _, inter = resolve(request_over(slow_link(tmp_path, 100e6), grad_compression="bf16", gpus="2"))
    assert f"--grad-compression bf16, {simulate(config, None, inter)[0].step_s:.3g} s" in text


def test_a_fast_link_or_one_node_needs_no_change(tmp_path) -> None:
    # At 100 Gbit/s the 0.5 GB of fp32 gradients take 43 ms, most of it under backward: bf16 gains under a quarter.
    assert advice(request_over(slow_link(tmp_path, 100e9))) is None
    assert advice(request_over(slow_link(tmp_path, 100e6), gpus="1", gpus_per_node=1)) is None
    # Compressed already: nothing more to offer on a one-GPU node.
    assert advice(request_over(slow_link(tmp_path, 100e6), grad_compression="powersgd")) is None


def test_hsdp_is_offered_where_nodes_hold_several_gpus_and_compression_only_where_it_gains(tmp_path) -> None:
    link = slow_link(tmp_path, 100e6)
    text = advice(request_over(link, strategy="zero3", gpus="4", gpus_per_node=2))
    assert text is not None and "--multi-gpu hsdp" in text
    assert "powersgd" not in text  # zero3 reduces through FSDP2, which takes no PowerSGD
    # bf16 halves the reduce-scatter alone: zero3 still gathers the fp32 weights twice, so a sixth of the bytes go
    assert "bf16" not in text


def test_the_cli_prints_the_advice_under_the_table(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from multigpu.cli import main

    args = ["simulate", "--model", "smollm2-135m", "--compute-s", "0.07", "--units-per-step", "2", "--gpus", "2"]
    assert main([*args, "--gpus-per-node", "1", "--inter-calibration", slow_link(tmp_path, 100e6)]) == 0
    assert "Predicted steps with --grad-compression powersgd, " in capsys.readouterr().out
