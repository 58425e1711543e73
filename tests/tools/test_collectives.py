"""The collectives benchmark: nccl-tests' sizes and bus-bandwidth factors, and a real 2-process run on gloo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from multigpu.core.errors import UsageError
from multigpu.tools.collectives import GLOO_REDUCE_SCATTER, OPS, CollectivesConfig, bus_factor, sizes
from tests.dist import run_command


def test_bus_bandwidth_factors_are_nccl_tests() -> None:
    # nccl-tests' PERFORMANCE.md: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n.
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 8) == 1.75
    assert bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 8) == 0.875
    assert all(bus_factor(op, 1) == 0 for op in OPS)  # one rank moves nothing


def test_sizes_grow_by_factor_and_split_evenly() -> None:
    config = CollectivesConfig(min_bytes=1024, max_bytes=65536, factor=4)
    assert sizes(config, 2) == [1024, 4096, 16384, 65536]
    # 3 ranks: rounded down to whole float32 elements per rank (multiples of 12 bytes).
    assert sizes(config, 3) == [1020, 4092, 16380, 65532]
    # Sizes below one element per rank become one element per rank, once.
    assert sizes(CollectivesConfig(min_bytes=4, max_bytes=64, factor=2), 4) == [16, 32, 64]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ops": "all_reduce,all_to_all"}, "--ops has unknown all_to_all; choose among all_reduce"),
        ({"ops": ","}, "--ops has unknown nothing"),
        ({"min_bytes": 2}, "4 <= --min-bytes <= --max-bytes"),
        ({"min_bytes": 4096, "max_bytes": 1024}, "4 <= --min-bytes <= --max-bytes"),
        ({"factor": 1}, "--factor must be 2 or more"),
        ({"iterations": 0}, "--iterations must be 1 or more"),
        ({"nproc": 0}, "--nproc and --iterations must be 1 or more"),
        ({"warmup": -1}, "--warmup 0 or more"),
    ],
)
def test_bad_configs_say_what_to_do(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        CollectivesConfig(**kwargs)


def test_two_processes_on_gloo(tmp_path: Path) -> None:
    out = tmp_path / "collectives.json"
    flags = ["--nproc", "2", "--min-bytes", "1024", "--max-bytes", "65536", "--iterations", "3", "--warmup", "1"]
    result = run_command(
        [sys.executable, "-m", "multigpu.tools.collectives", *flags, "--json-out", str(out)], timeout=90
    )
    assert result.returncode == 0, result.stdout
    report = json.loads(out.read_text())
    assert (report["backend"], report["world_size"], report["device"]) == ("gloo", 2, "cpu")
    rows = report["results"]
    assert [(row["op"], row["bytes"]) for row in rows] == [
        (op, size) for op in OPS for size in (1024, 4096, 16384, 65536)
    ]
    for row in rows:
        assert row["correct"], row
        assert row["time_s"] > 0
        assert row["algbw_GBps"] == row["bytes"] / row["time_s"] / 1e9
        assert row["busbw_GBps"] == row["algbw_GBps"] * bus_factor(row["op"], 2)
    # gloo's own reduce-scatter is an all-reduce in disguise: the substitute is reported, in the JSON and the output.
    assert report["notes"] == [GLOO_REDUCE_SCATTER]
    assert "note: reduce_scatter on gloo is timed as all_to_all_single" in result.stdout
    for op in OPS:
        assert f"{op}: 2 processes, gloo on cpu" in result.stdout


def test_bad_flags_exit_2_before_launching() -> None:
    result = run_command([sys.executable, "-m", "multigpu.tools.collectives", "--ops", "all_to_all"], timeout=60)
    assert result.returncode == 2
    assert "--ops has unknown all_to_all; choose among all_reduce, all_gather, reduce_scatter." in result.stdout
