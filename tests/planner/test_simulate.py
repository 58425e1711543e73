"""The scaling simulator: arithmetic only, no processes."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import math
import re

import pytest

from multigpu.core.errors import UsageError
from multigpu.planner.shapes import load_shape
from multigpu.planner.simulate import (
    INTERCONNECTS,
    Link,
    Prediction,
    SimulateConfig,
    all_gather,
    all_reduce,
    compute_time,
    flops_per_token,
    reduce_scatter,
    ring_time,
    simulate,
    simulate_mixed,
    tree_all_reduce,
)
from multigpu.tools.simulate_request import fit_link, load_calibration, to_json

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
BASE = SimulateConfig(params=350_000_000, layers=24, compute_s=0.05, units_per_step=8, gpus=(1, 2, 8, 16, 64))


def config(**changes: object) -> SimulateConfig:
    return dataclasses.replace(BASE, **changes)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_gpu_costs_no_communication(strategy: str) -> None:
    (p,) = simulate(config(strategy=strategy, gpus=(1,)))
    assert p.comm_s == 0 and p.exposed_comm_s == 0
    assert p.step_s == BASE.compute_s
    assert p.speedup == 1 and p.efficiency == 1
    assert p.throughput == BASE.units_per_step / BASE.compute_s


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("overlap", [True, False])
def test_step_time_falls_with_bandwidth_and_rises_with_latency(strategy: str, overlap: bool) -> None:
    c = config(strategy=strategy, overlap=overlap)

    def steps(link: Link) -> list[float]:
        return [p.step_s for p in simulate(c, intra=link, inter=link)]

    by_bandwidth = [steps(Link(5e-6, bw)) for bw in (1e9, 4e9, 16e9, 64e9, 256e9)]
    by_alpha = [steps(Link(alpha, 10e9)) for alpha in (0.0, 1e-6, 1e-5, 1e-4, 1e-3)]
    for slower, faster in itertools.pairwise(by_bandwidth):
        assert all(f <= s for s, f in zip(slower, faster, strict=True))
    for cheaper, dearer in itertools.pairwise(by_alpha):
        assert all(d >= c for c, d in zip(cheaper, dearer, strict=True))
    # Not trivially flat: the slowest link costs time the fastest does not.
    assert by_bandwidth[0][-1] > by_bandwidth[-1][-1]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_crossing_the_node_boundary_on_a_slower_link_lowers_efficiency(strategy: str) -> None:
    c = config(strategy=strategy, gpus=(8, 16), gpus_per_node=8, compute_s=0.02)
    one_node, two_nodes = simulate(c, intra=Link(3e-6, 300e9), inter=Link(30e-6, 12e9))
    assert (one_node.nodes, two_nodes.nodes) == (1, 2)
    assert two_nodes.efficiency < one_node.efficiency
    # The same fabric between nodes as within costs (almost) nothing more.
    _, flat = simulate(c, intra=Link(3e-6, 300e9), inter=Link(3e-6, 300e9))
    assert flat.efficiency > two_nodes.efficiency


def test_tree_wins_small_messages_on_many_ranks_and_ring_wins_large_ones() -> None:
    link = Link(5e-6, 100e9)
    small, large = 4096, 1e9
    assert tree_all_reduce(64, small, link) < ring_time("all_reduce", 64, small, link)
    assert all_reduce(64, small, link) == tree_all_reduce(64, small, link)
    assert ring_time("all_reduce", 8, large, link) < tree_all_reduce(8, large, link)
    assert all_reduce(8, large, link) == ring_time("all_reduce", 8, large, link)


def test_collective_formulas() -> None:
    link = Link(2e-6, 50e9)
    n, size = 4, 1e8
    assert ring_time("all_reduce", n, size, link) == pytest.approx(6 * 2e-6 + 1.5 * size / 50e9)
    assert all_gather(n, size, link) == pytest.approx(3 * 2e-6 + 0.75 * size / 50e9)
    assert reduce_scatter(n, size, link) == all_gather(n, size, link)
    assert tree_all_reduce(n, size, link) == pytest.approx(4 * 2e-6 + 2 * size / 50e9)
    assert all_reduce(1, size, link) == all_gather(1, size, link) == 0


def test_ddp_without_overlap_is_compute_plus_every_bucket() -> None:
    link = Link(10e-6, 10e9)
    c = config(params=60 * 2**20, grad_bytes=4, bucket_mb=100, gpus=(8,), overlap=False)  # 240 MiB: 100, 100, 40
    (p,) = simulate(c, intra=link)
    buckets = [all_reduce(8, mib * 2**20, link) for mib in (100, 100, 40)]
    assert p.comm_s == pytest.approx(sum(buckets))
    assert p.exposed_comm_s == p.comm_s
    assert p.step_s == pytest.approx(c.compute_s + sum(buckets))
    # With overlap only what backward cannot cover, and never less than the last bucket.
    (q,) = simulate(dataclasses.replace(c, overlap=True), intra=link)
    backward = c.compute_s * c.backward_fraction
    assert q.exposed_comm_s == pytest.approx(max(sum(buckets) - backward, buckets[-1]))
    assert q.exposed_comm_s < p.exposed_comm_s


def test_zero_strategies_add_their_collectives() -> None:
    link = Link(5e-6, 20e9)
    c = config(gpus=(8,), overlap=False, param_bytes=2)
    ddp, zero1, zero2, zero3 = (simulate(dataclasses.replace(c, strategy=s), intra=link)[0] for s in STRATEGIES)
    gather = all_gather(8, c.params * 2, link)
    assert zero1.comm_s == pytest.approx(ddp.comm_s + gather)
    assert zero2.comm_s > gather
    per_layer = 2 * all_gather(8, c.params * 2 / c.layers, link) + reduce_scatter(8, c.params * 4 / c.layers, link)
    assert zero3.comm_s == pytest.approx(c.layers * per_layer)
    assert simulate(dataclasses.replace(c, strategy="fsdp"), intra=link)[0] == zero3
    # Ample compute hides all but the first gather and the last scatter.
    (hidden,) = simulate(dataclasses.replace(c, strategy="zero3", overlap=True, compute_s=100.0), intra=link)
    edges = all_gather(8, c.params * 2 / c.layers, link) + reduce_scatter(8, c.params * 4 / c.layers, link)
    assert hidden.exposed_comm_s == pytest.approx(edges)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_efficiency_is_speedup_over_gpus(strategy: str) -> None:
    for p in simulate(config(strategy=strategy, interconnect="ethernet")):
        assert p.efficiency == p.speedup / p.gpus
        assert p.speedup == pytest.approx(p.throughput / (BASE.units_per_step / BASE.compute_s))
        assert p.per_gpu_throughput == pytest.approx(p.throughput / p.gpus)
        assert p.efficiency <= 1


def test_shared_cpu_slots_stretch_compute() -> None:
    two, four, eight = simulate(config(gpus=(2, 4, 8), compute_slots_per_node=2))
    assert two.compute_s == BASE.compute_s
    assert four.compute_s == pytest.approx(2 * BASE.compute_s)
    assert eight.compute_s == pytest.approx(4 * BASE.compute_s)


def test_presets_pick_links_by_node() -> None:
    one_node, two_nodes = simulate(config(gpus=(8, 16), interconnect="ethernet", intra="nvlink"))
    assert one_node == simulate(config(gpus=(8,)), intra=INTERCONNECTS["nvlink"])[0]
    slow = Link(INTERCONNECTS["ethernet"].alpha_s, INTERCONNECTS["ethernet"].bandwidth_Bps)
    assert two_nodes == simulate(config(gpus=(16,)), intra=INTERCONNECTS["nvlink"], inter=slow)[0]
    assert two_nodes.exposed_comm_s > one_node.exposed_comm_s
    assert json.loads(to_json([one_node]))[0]["gpus"] == 8


def timings(world_size: int, alpha: float, bandwidth: float) -> list[dict[str, object]]:
    rows = []
    for op, (hops, factor) in {
        "all_reduce": (2 * (world_size - 1), 2 * (world_size - 1) / world_size),
        "all_gather": (world_size - 1, (world_size - 1) / world_size),
        "reduce_scatter": (world_size - 1, (world_size - 1) / world_size),
    }.items():
        for size in (2**10, 2**14, 2**18, 2**22, 2**26):
            time = hops * alpha + factor * size / bandwidth
            rows.append({"op": op, "bytes": size, "time_s": time, "algbw_GBps": size / time / 1e9, "busbw_GBps": 0})
    return rows


@pytest.mark.parametrize(("world_size", "alpha", "bandwidth"), [(2, 50e-6, 1.2e9), (4, 3e-6, 300e9), (16, 0, 12e9)])
def test_fit_link_recovers_alpha_and_bandwidth(world_size: int, alpha: float, bandwidth: float) -> None:
    link = fit_link(timings(world_size, alpha, bandwidth), world_size)
    assert link.bandwidth_Bps == pytest.approx(bandwidth, rel=0.01)
    assert link.alpha_s == pytest.approx(alpha, rel=0.01, abs=1e-9)


def test_fit_link_clamps_negative_latency() -> None:
    rows = timings(4, 0.0, 10e9)
    rows[0]["time_s"] *= 0.9  # the smallest message beats bandwidth alone: unclamped, alpha would be < 0
    link = fit_link(rows, 4)
    assert link.alpha_s == 0
    assert link.bandwidth_Bps == pytest.approx(10e9, rel=0.02)


TWO_SIZES = "Calibration needs timings at two or more message sizes; rerun the benchmark with more."


@pytest.mark.parametrize(
    ("rows", "world_size", "message"),
    [
        ([{"op": "all_reduce", "bytes": 1024, "time_s": 1e-5}], 2, TWO_SIZES),  # one point
        ([{"op": "all_reduce", "bytes": 1024, "time_s": t} for t in (1e-5, 2e-5)], 2, TWO_SIZES),  # one size
        (
            [{"op": "all_reduce", "bytes": b, "time_s": t} for b, t in ((1e3, 1e-3), (1e6, 1e-4))],
            2,
            "The timings do not grow with message size, so no bandwidth fits",
        ),  # shrinking
        (timings(2, 1e-5, 1e9), 1, "Calibration needs timings from 2 or more ranks (got world_size 1)."),  # one rank
        (
            [{"op": "broadcast", "bytes": 1024, "time_s": 1e-5}],
            2,
            "A calibration result needs op, bytes and time_s (UsageError(\"Unknown collective 'broadcast'",
        ),
        (
            [{"op": "all_reduce", "bytes": 1024}],
            2,
            "A calibration result needs op, bytes and time_s (KeyError('time_s')",
        ),
    ],
)
def test_fit_link_refuses_what_cannot_fit(rows: list[dict[str, object]], world_size: int, message: str) -> None:
    with pytest.raises(UsageError, match=f"^{re.escape(message)}"):
        fit_link(rows, world_size)


def test_load_calibration(tmp_path) -> None:
    path = tmp_path / "collectives.json"
    rows = timings(2, 20e-6, 2e9)
    path.write_text(json.dumps({"backend": "nccl", "world_size": 2, "device": "gpu", "results": rows}))
    links = load_calibration(path)
    for link in links.values():
        assert link.bandwidth_Bps == pytest.approx(2e9, rel=0.01)
        assert link.alpha_s == pytest.approx(20e-6, rel=0.01)
    # On gloo, FSDP's reduce-scatter is a whole all-reduce: it costs what the all-reduce costs.
    path.write_text(json.dumps({"backend": "gloo", "world_size": 2, "device": "cpu", "results": rows}))
    links = load_calibration(path)
    for size in (1e3, 1e8):
        expected = ring_time("all_reduce", 2, size, links["all_reduce"])
        assert ring_time("reduce_scatter", 2, size, links["reduce_scatter"]) == pytest.approx(expected)
    with pytest.raises(UsageError, match="does not exist"):
        load_calibration(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_calibration(tmp_path / "bad.json")
    (tmp_path / "shape.json").write_text(json.dumps({"results": rows}))
    with pytest.raises(UsageError, match="world_size"):
        load_calibration(tmp_path / "shape.json")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"params": 0}, "--params must be positive and finite (got 0)."),
        ({"layers": 0}, "--layers must be 1 or more (got 0)."),
        ({"compute_s": 0.0}, "--compute-s must be positive and finite (got 0)."),
        ({"units_per_step": -1}, "--units-per-step must be positive and finite (got -1)."),
        ({"gpus": ()}, "--gpus must list GPU counts of 1 or more (got [])."),
        ({"gpus": (0, 8)}, "--gpus must list GPU counts of 1 or more (got [0, 8])."),
        ({"gpus_per_node": 0}, "--gpus-per-node must be 1 or more (got 0)."),
        ({"interconnect": "carrier-pigeon"}, "--interconnect must be one of nvlink, pcie, infiniband, ethernet"),
        ({"intra": "infiniband-ish"}, "--intra must be one of nvlink, pcie, infiniband, ethernet"),
        ({"strategy": "zero4"}, "--strategy must be one of ddp, zero1, zero2, zero3, fsdp, hsdp (got 'zero4')."),
        ({"grad_bytes": 0}, "--grad-bytes must be 1 or more (got 0)."),
        ({"param_bytes": 0}, "--param-bytes must be 1 or more (got 0)."),
        ({"bucket_mb": 0}, "--bucket-mb must be positive and finite (got 0)."),
        ({"backward_fraction": 1.0}, "--backward-fraction must lie between 0 and 1 (got 1)."),
        ({"compute_slots_per_node": 0}, "--compute-slots-per-node must be 1 or more (got 0)."),
        ({"compute_s": math.inf}, "--compute-s must be positive and finite (got inf)."),
        ({"units_per_step": math.inf}, "--units-per-step must be positive and finite (got inf)."),
        ({"bucket_mb": math.inf}, "--bucket-mb must be positive and finite (got inf)."),
    ],
)
def test_bad_configs_are_usage_errors(changes: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=f"^{re.escape(message)}"):
        config(**changes)


def test_gpus_per_node_message_says_what_to_do() -> None:
    with pytest.raises(UsageError, match=r"--gpus-per-node must be 1 or more \(got 0\)\."):
        config(gpus_per_node=0)


def test_bad_links_are_usage_errors() -> None:
    with pytest.raises(UsageError, match=re.escape("needs latency >= 0 and bandwidth > 0 (got -1e-06 s, 1e+09 B/s)")):
        Link(-1e-6, 1e9)
    with pytest.raises(UsageError, match=re.escape("needs latency >= 0 and bandwidth > 0 (got 1e-06 s, 0 B/s)")):
        Link(1e-6, 0)


def test_flops_per_token_and_compute_time() -> None:
    shape = load_shape("llama-3.1-8b")
    t = shape.transformer
    assert t is not None
    flops = flops_per_token(shape, 8192)
    assert flops == 6 * shape.params + 12 * t.layers * t.hidden * 8192
    assert 6e10 < flops < 6.2e10  # about 61 GFLOPs per token for an 8B model at 8k context
    seconds = compute_time(flops, 16384, tflops=989, mfu=0.4)
    assert seconds == pytest.approx(flops * 16384 / (989e12 * 0.4))
    assert math.isclose(compute_time(1e12, 1, 1, 1), 1.0)
    with pytest.raises(UsageError, match=re.escape("--tflops must be positive and --mfu in (0, 1] (got 989 and 0).")):
        compute_time(flops, 1, tflops=989, mfu=0)
    with pytest.raises(UsageError, match=re.escape("--seq-len must be 1 or more (got 0).")):
        flops_per_token(shape, 0)


def test_cli_from_flops_from_a_bench_report_and_its_errors(tmp_path) -> None:
    from tests.dist import multigpu, refusal

    result = multigpu(
        "simulate", "--model", "llama-3.1-8b", "--strategy", "zero3", "--gpus", "8,128", "--json",
        "--tflops", "989", "--mfu", "0.36", "--seq-len", "8192", "--batch-size", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout
    eight, many = json.loads(result.stdout)
    assert (eight["nodes"], many["nodes"], eight["unit"]) == (1, 16, "tokens")
    assert many["per_gpu_throughput"] <= eight["per_gpu_throughput"] and many["efficiency"] <= eight["efficiency"]
    # 6 x 8.03e9 + 12 x 32 x 4096 x 8192 FLOPs per token, 16,384 tokens per GPU, at 36% of 989 TFLOPS.
    assert eight["compute_s"] == pytest.approx(
        (6 * load_shape("llama-3.1-8b").params + 12 * 32 * 4096 * 8192) * 16384 / (0.36 * 989e12)
    )

    bench = tmp_path / "bench.json"
    cell = {
        "nproc": 1,
        "strategy": "single",
        "step_time_s": {"median": 0.02},
        "samples_per_s": {"median": 1600.0},
        "tokens_per_s": None,
    }
    bench.write_text(json.dumps({"cells": [cell]}))
    result = multigpu("simulate", "--params", "4e6", "--layers", "4", "--bench", str(bench), "--gpus", "1,2", "--json")
    one, two = json.loads(result.stdout)
    assert one["compute_s"] == 0.02 and one["throughput"] == pytest.approx(1600.0) and one["unit"] == "samples"
    assert two["step_s"] > one["step_s"]

    for flags, words in [
        (["--params", "1e9", "--compute-s", "1", "--tflops", "100"], "Give the compute time one way"),
        (["--params", "1e9", "--compute-s", "1"], "--compute-s needs --units-per-step"),
        (["--model", "llama-2-7b", "--params", "1e9", "--compute-s", "1"], "not both"),
        (["--params", "1e9", "--bench", str(tmp_path / "none.json")], "does not exist"),
    ]:
        printed = refusal("simulate", *flags)
        assert words in printed and printed.count("\n") == 1, printed


def calibration() -> dict:
    return {"backend": "nccl", "world_size": 2, "results": timings(2, 20e-6, 2e9)}


def bench_report() -> dict:
    def cell(nproc: int, strategy: str) -> dict:
        return {
            "nproc": nproc,
            "strategy": strategy,
            "step_time_s": {"median": 0.02},
            "samples_per_s": {"median": 1600.0},
        }

    return {"cells": [cell(2, "ddp"), {**cell(1, "single"), "tokens_per_s": None}]}


def changed(data: dict, path: str, value: object) -> str:
    """`data` as JSON text with the value at `path` ("results.2.time_s") replaced, or removed if `value` is ..."""
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    inner = data
    for key in parents:
        inner = inner[key]
    if value is ...:
        del inner[last]
    else:
        inner[last] = value
    return json.dumps(data)  # writes NaN and Infinity as Python's json reads them


BAD_CALIBRATIONS = [
    ("results.2.time_s", math.nan, "results[2].time_s is NaN, but a finite number is expected"),
    ("results.0.busbw_GBps", -math.inf, "results[0].busbw_GBps is -Infinity, but a finite number"),
    ("results.1.bytes", "1024", 'results[1].bytes is "1024", but a number above 0 is expected'),
    ("results.1.time_s", True, "results[1].time_s is true, but a number above 0 is expected"),
    ("results.1.time_s", 0, "results[1].time_s is 0, but a number above 0 is expected"),
    ("results.3.op", "broadcast", 'results[3].op is "broadcast", but one of "all_reduce", "all_gather"'),
    ("results.3.op", ..., "results[3].op is missing, but one of"),
    ("world_size", ..., "world_size is missing, but an integer of 2 or more is expected"),
    ("world_size", 1, "world_size is 1, but an integer of 2 or more is expected"),
    ("world_size", 2.0, "world_size is 2.0, but an integer"),
    ("results", {"all_reduce": []}, "results is an object, but a non-empty list is expected"),
    ("results", [], "results is an empty list, but a non-empty list is expected"),
    ("results", [[1024, 1e-5]], "results[0] is a list, but an object is expected"),
    ("backend", 3, "backend is 3, but a string is expected"),
]
BAD_BENCH_REPORTS = [
    ("cells.1.step_time_s.median", math.inf, "cells[1].step_time_s.median is Infinity, but a finite number"),
    ("cells.1.step_time_s.median", "fast", 'cells[1].step_time_s.median is "fast", but a number above 0'),
    ("cells.1.step_time_s", [0.02], "cells[1].step_time_s is a list, but an object is expected"),
    ("cells.1.samples_per_s", ..., "cells[1].samples_per_s is missing, but an object is expected"),
    ("cells.1.tokens_per_s", [], "cells[1].tokens_per_s is an empty list, but an object or null is expected"),
    ("cells.0.nproc", "2", 'cells[0].nproc is "2", but an integer of 1 or more is expected'),
    ("cells.1.strategy", None, "cells[1].strategy is null, but a string is expected"),
    ("cells", {"single": {}}, "cells is an object, but a non-empty list is expected"),
    ("cells", [], "cells is an empty list, but a non-empty list is expected"),
    ("cells", ..., "cells is missing, but a non-empty list is expected"),
]


@pytest.mark.parametrize(
    ("flag", "path", "value", "message"),
    [("--calibration", *case) for case in BAD_CALIBRATIONS]
    + [("--inter-calibration", "world_size", "2", 'world_size is "2", but an integer')]
    + [("--bench", *case) for case in BAD_BENCH_REPORTS],
    ids=lambda value: value if isinstance(value, str) and value.startswith("-") else None,
)
def test_a_bad_json_input_is_one_sentence_naming_file_and_key(
    tmp_path, capsys: pytest.CaptureFixture, flag: str, path: str, value: object, message: str
) -> None:
    from multigpu.cli import main

    file = tmp_path / "input.json"
    file.write_text(changed(bench_report() if flag == "--bench" else calibration(), path, value))
    timing = [] if flag == "--bench" else ["--compute-s", "0.1", "--units-per-step", "8"]
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--params", "1e8", "--gpus", "1,2", *timing, flag, str(file)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"multigpu: error: {file}: {message}") and err.count("\n") == 1, err


def test_the_valid_json_inputs_those_cases_start_from_are_accepted(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from multigpu.cli import main

    (tmp_path / "calibration.json").write_text(json.dumps(calibration()))
    (tmp_path / "bench.json").write_text(json.dumps(bench_report()))
    calibrated = [f"--{side}calibration={tmp_path / 'calibration.json'}" for side in ("", "inter-")]
    main(
        ["simulate", "--params", "1e8", "--gpus", "1,2", "--json", "--bench", str(tmp_path / "bench.json"), *calibrated]
    )
    one, _ = json.loads(capsys.readouterr().out)
    assert one["compute_s"] == 0.02 and one["unit"] == "samples"


@pytest.mark.parametrize("flag", ["--calibration", "--bench"])
def test_a_directory_given_as_a_json_file_is_named_as_one(tmp_path, capsys: pytest.CaptureFixture, flag: str) -> None:
    from multigpu.cli import main

    with pytest.raises(SystemExit) as exit_info:
        timing = [] if flag == "--bench" else ["--compute-s", "1", "--units-per-step", "1"]
        main(["simulate", "--params", "1e8", *timing, flag, str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{flag} {tmp_path} is a directory, but a" in capsys.readouterr().err


# -- tensor and pipeline parallelism ---------------------------------------------------------------------------
LAYOUT = {
    "params": 8_000_000_000,
    "layers": 32,
    "compute_s": 8.0,
    "units_per_step": 8 * 4096,
    "unit": "tokens",
    "hidden": 4096,
    "strategy": "fsdp",
}


def predict(**changes: object) -> Prediction:
    (prediction,) = simulate(SimulateConfig(**{**LAYOUT, **changes}))
    return prediction


def test_tp_and_pp_of_one_change_nothing() -> None:
    plain = SimulateConfig(**{**LAYOUT, "gpus": (8, 64)})
    layout = SimulateConfig(**{**LAYOUT, "gpus": (8, 64), "tp_size": 1, "pp_size": 1, "microbatches": 4})
    assert simulate(plain) == simulate(layout)


def test_gpipe_bubble_is_three_sevenths_with_four_stages_and_four_micro_batches() -> None:
    p = predict(gpus=(4,), pp_size=4, microbatches=4, pp_schedule="gpipe")
    assert p.compute_s == pytest.approx(LAYOUT["compute_s"] / 4)
    assert p.bubble_s / (p.compute_s + p.bubble_s) == pytest.approx(3 / 7)
    interleaved = predict(gpus=(4,), pp_size=4, microbatches=4, pp_schedule="interleaved", pp_stages_per_rank=2)
    assert interleaved.bubble_s / (interleaved.compute_s + interleaved.bubble_s) == pytest.approx(3 / 11)
    # zbv: 8 micro-batches (its default on 4 ranks: one per stage) idle 3 stage-forwards beside 3 x 2 x 8.
    zbv = predict(gpus=(4,), pp_size=4, pp_schedule="zbv")
    assert zbv.bubble_s / (zbv.compute_s + zbv.bubble_s) == pytest.approx(3 / 51)


def test_tp_adds_four_all_reduces_per_layer_on_the_intra_node_link() -> None:
    p = predict(gpus=(8,), tp_size=8)
    activations = LAYOUT["units_per_step"] * LAYOUT["hidden"] * 2
    expected = 4 * LAYOUT["layers"] * all_reduce(8, activations, INTERCONNECTS["nvlink"])
    assert p.comm_s == pytest.approx(expected) and p.exposed_comm_s == pytest.approx(expected)
    recomputed = predict(gpus=(8,), tp_size=8, activation_checkpointing="full")
    assert recomputed.comm_s == pytest.approx(expected * 6 / 4)
    hidden = predict(gpus=(8,), tp_size=8, tp_overlap=True)
    assert hidden.exposed_comm_s == 0.0 and hidden.step_s == pytest.approx(p.compute_s)


def test_throughput_counts_replicas_not_gpus() -> None:
    p = predict(gpus=(16,), tp_size=8, overlap=False)
    assert p.per_gpu_throughput == pytest.approx(2 * LAYOUT["units_per_step"] / p.step_s / 16)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gpus": (4, 8), "tp_size": 8}, "--gpus 4 cannot be split into tp 8 x pp 1 groups; list multiples of 8."),
        ({"gpus": (8,), "tp_size": 8, "hidden": 0}, "tp, pp and cp move activations, so they need the model's width"),
        ({"gpus": (8,), "pp_size": 2, "pp_stages_per_rank": 2}, "pp_stages_per_rank 2 does not fit pp_schedule"),
    ],
)
def test_bad_layouts_are_usage_errors(changes: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=f"^{re.escape(message)}"):
        SimulateConfig(**{**LAYOUT, **changes})


def test_cli_takes_the_layout(capsys: pytest.CaptureFixture) -> None:
    from multigpu.cli import main

    args = ["simulate", "--model", "llama-3.1-70b", "--strategy", "fsdp", "--tp-size", "8", "--tflops", "989"]
    assert main([*args, "--json"]) == 0
    gpus = [p["gpus"] for p in json.loads(capsys.readouterr().out)]
    assert gpus == [8, 16, 32, 64, 128]  # the default list, kept to the counts tp 8 divides
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--params", "7e9", "--tp-size", "2", "--tflops", "989", "--gpus", "2"])
    assert exit_info.value.code == 2 and "give --model" in capsys.readouterr().err


def test_grad_compression_sets_the_gradient_bytes_reduced() -> None:
    """bf16/fp16 send 2 bytes per gradient element; PowerSGD rank r sends r (m + n) per m x n matrix and every
    vector whole; zero2/zero3 cannot take PowerSGD and a model given by its count has no matrices to factor."""
    from multigpu.parallel.compression import Compression, payload_bytes
    from multigpu.planner.simulate import strategy_comm
    from multigpu.tools.simulate_request import SimulateRequest, gradient_shapes, resolve

    shape = load_shape("smollm2-135m")
    assert sum(math.prod(s) for s in gradient_shapes(shape.transformer)) == shape.params
    request = {"model": "smollm2-135m", "compute_s": 1.0, "units_per_step": 1.0, "gpus": "8"}
    plain, _, _ = resolve(SimulateRequest(**request))
    half, _, _ = resolve(SimulateRequest(**request, grad_compression="bf16"))
    factored, _, _ = resolve(SimulateRequest(**request, grad_compression="powersgd:4"))
    assert plain.grad_payload is None and half.grad_payload == 2 * shape.params
    want = payload_bytes(gradient_shapes(shape.transformer), Compression("powersgd", 4), 4)
    assert factored.grad_payload == want < shape.params * 4 / 10  # 576 x 1536 at rank 4: 1% of the matrix
    comm = [strategy_comm(c, 8, INTERCONNECTS["pcie"], 1.0)[0] for c in (plain, half, factored)]
    assert comm[2] < comm[1] < 0.6 * comm[0]  # bf16: half the bytes, the same latency
    with pytest.raises(UsageError, match="zero3 reduces through FSDP2"):
        resolve(SimulateRequest(**request, strategy="zero3", grad_compression="powersgd"))
    with pytest.raises(UsageError, match="give --model instead of --params"):
        resolve(SimulateRequest(**{**request, "model": None, "params": 1e8}, grad_compression="powersgd"))


def test_gpus_of_different_speeds_balanced_by_speed_finish_together() -> None:
    """One GPU at twice the other's peak: with the same batch each, the slow one takes 2x the fast one's step; with
    shares 2:1 of the same global batch, each takes 2 x 2 / 3 of it. A small model on NVLink hides its all-reduce,
    so the step is the compute: 1.5x."""
    small = config(params=1_000_000, layers=4, compute_s=1.0, units_per_step=8)
    mixed = simulate_mixed(small, [2.0, 1.0])
    assert mixed.shares == pytest.approx((2 / 3, 1 / 3))
    assert mixed.even.compute_s == pytest.approx(2.0) and mixed.balanced.compute_s == pytest.approx(4 / 3)
    assert mixed.speedup == pytest.approx(1.5, rel=1e-3)
    assert mixed.even.gpus == mixed.balanced.gpus == 2 and mixed.balanced.comm_s == mixed.even.comm_s > 0
    alike = simulate_mixed(small, [3.0, 3.0, 3.0])  # one speed: nothing to balance
    assert alike.speedup == pytest.approx(1.0) and alike.shares == pytest.approx((1 / 3,) * 3)


def test_cli_for_gpus_of_different_speeds_and_its_refusals() -> None:
    from multigpu.cli import main
    from tests.dist import refusal

    args = ["simulate", "--model", "llama-3.1-8b", "--strategy", "zero3", "--tflops", "4x989,4x312", "--json"]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(args) == 0
    report = json.loads(printed.getvalue())
    assert report["tflops"] == [989.0] * 4 + [312.0] * 4 and report["even"]["gpus"] == 8
    assert report["shares"][0] == pytest.approx(989 / (4 * 989 + 4 * 312))
    # compute-bound: the slowest GPU's time for the even batch over the balanced time, sum of speeds / (8 x slowest)
    assert report["speedup"] == pytest.approx((4 * 989 + 4 * 312) / (8 * 312), rel=0.01)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(args[:-1]) == 0
    assert "balanced by: --batch-shares 989,989,989,989,312,312,312,312" in printed.getvalue()
    for flags, words in [
        (["--tflops", "4x989,4x312", "--gpus", "4"], "--tflops lists 8 GPUs and --gpus 4 says otherwise"),
        (["--tflops", "2x989,0x312"], "--tflops '2x989,0x312' must list one value per GPU or COUNTxVALUE groups"),
        (["--tflops", "989,312", "--tp-size", "2"], "simulated under data parallelism alone"),
        (["--tflops", "989,-312"], "--tflops must be positive"),
    ]:
        printed = refusal("simulate", "--model", "llama-3.1-8b", *flags)
        assert words in printed and printed.count("\n") == 1, printed
