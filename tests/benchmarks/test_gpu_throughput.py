"""benchmarks/gpu_throughput.py on the CPU, so that the script waiting for a GPU cannot rot: its arguments, its rows'
settings, its refusal of a row whose setting the Engine did not apply, its time limits, MFU and the table, and a
smoke run of the eager row on a 2-layer Llama (a few seconds)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import fields
from pathlib import Path
from types import ModuleType

import pytest

from multigpu.engine.config import EngineConfig
from tests.dist import ROOT


def load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_throughput", ROOT / "benchmarks" / "gpu_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_benchmark()


def test_the_smoke_run_trains_the_eager_row_and_writes_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "results.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["tokens_per_s"] > 0 and row["peak_memory_gib"] > 0, row
    assert row["tokens_per_step"] == 2 * 32 and row["mfu"] is None  # a CPU has no peak figure to divide by
    # The FLOPs come from the Engine's own counter. On a CPU, torch's counter has no formula for attention's CPU
    # kernel, so it counts the matrix products alone: 6 per parameter per token, every parameter but the RMSNorm
    # weights (2 per layer and the final one) taking part in one (the tied embedding as the output head).
    shape = bench.MODELS["smoke"]
    norms = shape["hidden_size"] * (2 * shape["num_hidden_layers"] + 1)
    assert report["flops_per_token"] == 6 * (row["params"] - norms)
    table = capsys.readouterr().out
    assert "| eager bf16 | " in table and "| torchtitan, same, + compile + float8 | 8,532 |" in table


def test_each_row_adds_its_settings_to_the_rows_before_it_and_names_engine_settings() -> None:
    assert bench.row_settings("eager") == {}
    assert bench.row_settings("selective_ac") == {"compile": True, "activation_checkpointing": "selective"}
    last = bench.row_settings("fused_loss")
    assert last == {"compile": True, "activation_checkpointing": "selective", "float8": "tensorwise"} | {
        "loss": "fused",
        "liger": True,
    }
    assert set(last) <= {f.name for f in fields(EngineConfig)}
    EngineConfig(strategy="single", **last)  # each value among its setting's choices


def test_a_setting_the_engine_left_unapplied_fails_its_row_naming_each() -> None:
    model = bench.build_model("smoke")  # as the plain path leaves it: nothing converted, patched or compiled
    watch = bench.LogitsWatch(model.get_output_embeddings(), model.config.vocab_size)
    watch.saw_whole_logits = True
    bench.check_applied(model, {}, watch)  # the eager row asks for nothing
    with pytest.raises(RuntimeError) as raised:
        bench.check_applied(model, bench.row_settings("fused_loss"), watch)
    for setting in ("activation_checkpointing='selective'", "compile=True", "float8='tensorwise'", "liger=True"):
        assert setting in str(raised.value)
    assert "loss='fused' still handed the whole logits tensor" in str(raised.value)


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_the_watch_sees_the_whole_logits_under_the_plain_loss_alone(loss: str) -> None:
    """The rows' loss is engine.lm_loss's (the Engine refuses a loss setting without it): under chunked, as under
    fused, the head hands the hidden states through and the whole logits never exist."""
    import torch

    import multigpu as mg

    args = bench.parse_args(["--smoke"])
    engine = mg.Engine(strategy="single", loss=loss, seed=0)
    model = bench.build_model(args.model)
    model, _ = engine.setup(model, torch.optim.AdamW(model.parameters()))
    watch = bench.LogitsWatch(model.get_output_embeddings(), model.config.vocab_size)
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len))
    loss_fn = engine.lm_loss(model.get_output_embeddings())
    summed, count = engine.forward_loss(model, {"input_ids": ids}, ids, loss_fn)
    assert watch.saw_whole_logits == (loss == "plain")
    assert 0 < float(summed) / int(count) < 2 * math.log(model.config.vocab_size)  # about log(vocabulary) at init


def test_a_row_past_its_time_is_killed_and_a_failing_row_says_why(tmp_path: Path) -> None:
    result = tmp_path / "row.json"
    slow = bench.run_in_subprocess([sys.executable, "-c", "import time; time.sleep(60)"], result, timeout=0.5)
    assert slow["status"] == "failed" and slow["error"] == "timed out after 0 s", slow
    broken = bench.run_in_subprocess([sys.executable, "-c", "raise SystemExit('the reason')"], result, timeout=30)
    assert broken == {"status": "failed", "error": "the reason", "output": "the reason\n"}


def test_a_spent_budget_leaves_rows_not_run_and_the_table_says_so() -> None:
    args = bench.parse_args(["--smoke", "--rows", "eager,compile", "--budget-s", "0"])
    results = bench.run_rows(args, [])
    assert [(r["row"], r["status"]) for r in results] == [("eager", "not run"), ("compile", "not run")]
    assert "| + compile | not run: the 0 s budget was spent |" in bench.format_table(results, "CPU", None)


def test_mfu_is_every_row_s_tokens_times_the_eager_row_s_flops_per_token() -> None:
    eager = {"row": "eager", "status": "ok", "flops_per_step": 4e12, "tokens_per_step": 4000, "tokens_per_s": 1e5}
    compiled = {"row": "compile", "status": "ok", "tokens_per_s": 2e5}
    failed = {"row": "float8", "status": "failed", "error": "RuntimeError: no"}
    assert bench.add_mfu([eager, compiled, failed], peak_tflops=1000.0) == 1e9
    assert (eager["mfu"], compiled["mfu"], failed["mfu"]) == (pytest.approx(0.1), pytest.approx(0.2), None)
    assert bench.add_mfu([compiled], peak_tflops=1000.0) is None and compiled["mfu"] is None  # no eager count
    assert "this run has none; run that row" in bench.format_table(
        [compiled | {"step_s": 1.0, "peak_memory_gib": 1.0, "compile_s": None}], "H100", 1000.0
    )


def test_arguments_refused_before_anything_runs() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "eager,fastest"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--warmup", "1"])
    assert bench.parse_args(["--smoke", "--rows", "compile"]).rows == ["compile"]
