"""`multigpu bench` on real processes: the report's figures are present and consistent with each other."""

import json
from pathlib import Path

import pytest

from multigpu.tools.bench import summarise
from tests.dist import multigpu, refusal

SCRIPT = "tests/scripts/next_token.py"
PNG = b"\x89PNG\r\n\x1a\n"


def bench(out: Path, *flags: str) -> dict:
    result = multigpu("bench", "--out", str(out), "--steps", "4", "--warmup", "2", *flags, timeout=300)
    assert result.returncode == 0, result.stdout
    assert "speedup" in result.stdout and "efficiency" in result.stdout
    return json.loads((out / "bench.json").read_text())


def test_script_over_process_counts_and_strategies(tmp_path: Path) -> None:
    """Each cell run once (a launch each, and one more for the 2 processes' run without gradient sync): how the
    runs of a cell repeated are summed up is the test below's, on runs whose figures it knows."""
    report = bench(tmp_path, "--nproc", "1,2", "--strategies", "zero3", "--repeats", "1", SCRIPT)
    cells = {(c["nproc"], c["strategy"]): c for c in report["cells"]}
    assert set(cells) == {(1, "single"), (2, "zero3")}
    assert report["device"] == "cpu" and report["precision"] == "32"
    for (n, _), cell in cells.items():
        assert cell["repeats"] == 1 and len(cell["peak_memory_mb"]) == n
        assert all(m > 0 for m in cell["peak_memory_mb"])
        for rate in ("samples_per_s", "tokens_per_s"):
            assert 0 < cell[rate]["min"] <= cell[rate]["median"] <= cell[rate]["max"]
        # Sequences hold 2 to 15 target tokens, so tokens per sample must fall in between.
        assert 2 <= cell["tokens_per_s"]["median"] / cell["samples_per_s"]["median"] <= 15
        assert 0 < cell["step_time_s"]["median"] <= cell["step_time_s"]["p90"]
        assert abs(cell["efficiency"] - cell["speedup"] / n) < 1e-12
        assert (cell["comm_share"] is None) == (n == 1)
        if n > 1:
            assert 0 <= cell["comm_share"] < 1
    assert cells[1, "single"]["speedup"] == 1.0
    base = cells[1, "single"]["samples_per_s"]["median"]
    assert abs(cells[2, "zero3"]["speedup"] - cells[2, "zero3"]["samples_per_s"]["median"] / base) < 1e-12
    for plot in ("speedup.png", "memory.png"):
        assert (tmp_path / plot).read_bytes()[:8] == PNG


def run(times: list[float], memory_mb: list[int]) -> dict:
    """One run of a 2-process cell as run_cell returns it: 8 samples of 5 tokens in `times`."""
    return {"times": times, "samples": 8, "tokens": 40, "memory": [mb * 2**20 for mb in memory_mb], "grad_bytes": 64,
            "state_bytes": [16, 16], "state_elements": [2, 2], "gathered_bytes": 0}  # fmt: skip


def test_a_cells_repeated_runs_are_reported_as_their_min_median_and_max() -> None:
    """--repeats 3: each rate's min / median / max over the runs (each run's samples over its own time), the step
    times pooled, each rank's peak memory the highest of any run, the sync's share from the unsynced runs' steps."""
    runs = [run([0.1, 0.2], [100, 300]), run([0.3, 0.2], [200, 250]), run([0.15, 0.25], [150, 250])]
    unsynced = [run([0.05, 0.1], [100, 100]), run([0.1, 0.15], [100, 100]), run([0.2, 0.2], [100, 100])]
    cell = summarise(2, "zero3", runs, unsynced)
    assert cell["repeats"] == 3 and cell["peak_memory_mb"] == [200, 300]
    assert cell["samples_per_s"] == pytest.approx({"min": 8 / 0.5, "median": 8 / 0.4, "max": 8 / 0.3})
    assert cell["tokens_per_s"] == pytest.approx({"min": 40 / 0.5, "median": 40 / 0.4, "max": 40 / 0.3})
    # Six step times, 0.1 to 0.3: the median between the 3rd and 4th (0.2, 0.2), p90 at 4.5 of 0-5 (0.25 to 0.3).
    assert cell["step_time_s"] == pytest.approx({"median": 0.2, "p90": 0.275})
    assert cell["comm_share"] == pytest.approx(1 - 0.125 / 0.2)  # unsynced steps' median: (0.1 + 0.15) / 2
    assert cell["grad_bytes_sent"] == 64 and cell["state_bytes_per_param"] == 8.0


def test_recipe_train_with_each_gradient_compression(tmp_path: Path) -> None:
    compressions = ("none", "bf16")  # powersgd's bytes: tests/parallel/test_compression.py
    flags = ("--nproc", "2", "--repeats", "1", "--no-comm-share", "--grad-compressions", ",".join(compressions))
    report = bench(tmp_path, "--recipe", "train", *flags)
    assert [cell["grad_compression"] for cell in report["cells"]] == list(compressions)
    for cell in report["cells"]:
        assert cell["nproc"] == 2 and cell["strategy"] == "ddp" and cell["speedup"] is None
        assert cell["tokens_per_s"] is None and cell["comm_share"] is None
    assert "multigpu.recipes.train" in report["target"]
    # 2 processes: a ring all-reduce sends 2 (n - 1) / n = 1 times the payload; bf16 halves fp32's 4 bytes.
    sent = {cell["grad_compression"]: cell["grad_bytes_sent"] for cell in report["cells"]}
    assert sent["none"] > 0 and sent["bf16"] == sent["none"] / 2


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for flags, words in [
        (["--strategies", "dp", SCRIPT], "--strategies has dp"),
        (["--grad-compressions", "none,int8", SCRIPT], "Unknown grad_compression 'int8'"),
        (["--nproc", "0,2", SCRIPT], "process counts of 1 or more"),
        (["--nproc", "1,3", "--cp-size", "2", SCRIPT], "--cp-size 2 splits each sequence over that many processes"),
        ([], "Give bench a SCRIPT or --recipe train|finetune"),
        (["--collectives", SCRIPT], "drop SCRIPT"),
    ]:
        printed = refusal("bench", "--out", str(tmp_path), *flags)
        assert words in printed and len(printed.strip().splitlines()) == 1, printed


def test_a_usage_error_in_the_script_is_printed_once(tmp_path: Path) -> None:
    """The Engine refuses the script's settings on both ranks: one sentence, not a traceback per rank."""
    script = tmp_path / "bad_settings.py"
    script.write_text("import multigpu\nmultigpu.Engine(strategy='ddp', grad_accum_steps=0)\n")
    result = multigpu("bench", "--out", str(tmp_path), "--nproc", "2", "--strategies", "ddp", str(script))
    assert result.returncode == 2, result.stdout
    assert result.stdout.splitlines() == ["multigpu: error: grad_accum_steps must be 1 or more (got 0)."]
