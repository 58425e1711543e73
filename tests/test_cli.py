"""Bad input: one clear sentence and exit code 2, before any process starts; a stop by signal: one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from multigpu import checkpoint
from multigpu.cli import build_parser, main
from multigpu.config import config_file
from multigpu.config.flags import finite_float
from multigpu.launch import launcher
from tests.dist import ROOT, multigpu, run_command

VERBS = config_file.verb_parsers(build_parser())
FLOAT_FLAGS = [
    (verb, action.option_strings[-1])
    for verb, parser in VERBS.items()
    for action in parser._actions
    if action.type in (float, finite_float)
]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "fsdp3"], "invalid choice: 'fsdp3'"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--grad-accum-steps", "0"], "grad_accum_steps must be 1 or more (got 0)."),
        (["--backend", "nccl"], "The nccl backend needs CUDA GPUs"),
        (["--strategy", "single"], "Strategy single runs in one process, but 2 were launched"),
        (["--strategy", "ddp", "--cpu-offload"], "cpu_offload is an option of strategy zero3 or hsdp, not of"),
        (["--strategy", "zero3", "--cpu-offload"], "this run is on CPU already"),
        (["--max-grad-norm", "-1"], "max_grad_norm must be a positive finite number"),
    ],
)
def test_bad_demo_input(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) <= 3  # one sentence (argparse adds its usage line first)


def test_usage_error_exits_2_from_the_installed_command() -> None:
    result = multigpu("demo", "--grad-accum-steps", "0")
    assert result.returncode == 2
    assert result.stdout.strip() == "multigpu: error: grad_accum_steps must be 1 or more (got 0)."


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("multigpu.recipes.train", ["--epochs", "0"], "--epochs must be 1 or more"),
        ("multigpu.recipes.demo", ["--grad-accum-steps", "0"], "grad_accum_steps must be 1 or more (got 0)."),
        ("multigpu.tools.collectives", ["--iterations", "0"], "--iterations"),
    ],
)
def test_the_python_m_entry_points_exit_2_with_one_sentence(module: str, args: list[str], message: str) -> None:
    """What `torchrun -m multigpu.recipes.train ...` runs turns a UsageError into exit 2 as the CLI does."""
    result = run_command([sys.executable, "-m", module, *args], timeout=60)
    assert result.returncode == 2, result.stdout
    assert result.stdout.startswith("multigpu: error: ") and message in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1


def test_the_float_flags_are_found() -> None:
    """The table below is built from the parsers: it holds the float flags of the recipes, tools and plain flags."""
    assert {("train", "--timeout-s"), ("finetune", "--lr"), ("demo", "--max-grad-norm"), ("plan", "--params")} < set(
        FLOAT_FLAGS
    )
    assert {("env", "--size-mb"), ("generate", "--temperature"), ("verify", "--loss-tolerance")} < set(FLOAT_FLAGS)


@pytest.mark.parametrize("value", ["nan", "inf", "NaN", "1e999"])
@pytest.mark.parametrize(("verb", "flag"), FLOAT_FLAGS)
def test_every_float_flag_of_every_verb_takes_finite_numbers_only(
    verb: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """float() reads nan and inf: nan passes every range check (each comparison is false), inf overflows. The
    parser refuses them, so nothing runs; `multigpu VERB` prints this line (the test below runs one)."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([verb, flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"multigpu {verb}: error: argument {flag}: takes a finite number, not {value}; see `multigpu {verb} --help`.\n"
    )


@pytest.fixture
def no_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails a test whose command would start workers (every launch goes through torch_run)."""

    def started(args: object) -> None:
        raise AssertionError("workers were started")

    monkeypatch.setattr(launcher, "torch_run", started)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--timeout-s", "1e15"], "timeout_s must be a positive number of seconds up to 1,000,000,000"),
        (["train", "--timeout-s", "0"], "timeout_s must be a positive number of seconds"),
        (["finetune", "--timeout-s", "-5"], "timeout_s must be a positive number of seconds"),
        (["demo", "--timeout-s", "9e9"], "timeout_s must be a positive number of seconds"),
        (["train", "--max-grad-norm", "0"], "max_grad_norm must be a positive finite number (got 0.0)"),
        (["train", "--multi-gpu", "hsdp", "--replicate", "0"], "replicate must be 1 or more (got 0)"),
        (["finetune", "--multi-gpu", "hsdp", "--replicate", "0"], "replicate must be 1 or more (got 0)"),
        (["demo", "--strategy", "hsdp", "--replicate", "-1"], "replicate must be 1 or more (got -1)"),
        (["train", "--seed", "-1"], "seed must be from 0 to 2**32 - 1"),
        (["finetune", "--seed", "4294967296"], "seed must be from 0 to 2**32 - 1"),
        (["train", "--peak-tflops", "0"], "peak_tflops must be a positive finite number"),
        (["finetune", "--log-every", "-1"], "log_every must be 0 or more"),
        (["finetune", "--grad-accum-steps", "0"], "grad_accum_steps must be 1 or more"),
        (["train", "--weight-decay", "-1"], "weight_decay must be 0 or a positive number (got -1.0)."),
        (["train", "--num-workers", "-1"], "--num-workers must be 0 or more"),
        (["finetune", "--warmup-steps", "-1"], "--warmup-steps must be 0 or more"),
        (["finetune", "--save-every", "-1"], "--save-every must be 0 or more"),
        (["demo", "--epochs", "0"], "--epochs must be 1 or more"),
        (["demo", "--batch-size", "0"], "--batch-size must be 1 or more"),
        (["demo", "--lr", "0"], "--lr must be a positive finite number"),
        (["demo", "--samples", "0"], "--samples must be 1 or more"),
    ],
)
def test_settings_no_run_can_use_are_refused_before_any_worker_starts(
    args: list[str], message: str, tmp_path, no_worker_starts: None, capsys: pytest.CaptureFixture[str]
) -> None:
    verb, *rest = args
    with pytest.raises(SystemExit) as exit_info:
        main([verb, "--nproc", "2", *rest, *(["--save-dir", str(tmp_path / "run")] if verb != "demo" else [])])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("multigpu: error: ") and message in err and err.count("\n") == 1, err


def test_a_nan_timeout_is_one_line_and_starts_no_worker(tmp_path) -> None:
    """As a user types it: one line, exit 2, and no worker's output (a worker that started would print its own
    traceback, and torchrun its report)."""
    result = multigpu("train", "--nproc", "2", "--timeout-s", "nan", "--save-dir", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert result.stdout == (
        "multigpu train: error: argument --timeout-s: takes a finite number, not nan; see `multigpu train --help`.\n"
    )
    assert not any(tmp_path.iterdir())


def test_no_flag_states_its_default_twice() -> None:
    """A help that says its default in words ("one per node") gets no generic "(default: None)" after it."""
    twice = [
        f"{verb} {action.option_strings[-1]}: {action.help}"
        for verb, parser in VERBS.items()
        for action in parser._actions
        if (action.help or "").count("(default") > 1
    ]
    assert not twice, "\n".join(twice)


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--strategy",
        "--precision",
        "--grad-accum-steps",
        "--max-grad-norm",
        "--seed",
        "--cpu-offload",
        "--backend",
        "--timeout-s",
        "--epochs",
        "--batch-size",
        "--lr",
        "--nproc",
    ):
        assert flag in out


@pytest.mark.parametrize(
    "args",
    [
        ["run", "-n", "0", "script.py"],
        ["run", "--nproc", "0", "script.py"],
        ["demo", "--nproc", "0"],
        ["train", "--nproc", "0"],
        ["finetune", "--nproc", "0"],
        ["bench", "--nproc", "0", "script.py"],
        ["bench", "--nproc", "1,0", "script.py"],
        ["verify", "--nproc", "0", "script.py"],
        ["generate", "--nproc", "0", "--prompts", "PROMPTS", "--out", "out.jsonl"],
        ["env", "--nproc", "0"],
    ],
)
def test_zero_processes_are_refused_by_every_command(
    args: list[str], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    with pytest.raises(SystemExit) as exit_info:
        main([str(prompts) if arg == "PROMPTS" else arg for arg in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nproc" in err and "1 or more" in err, err


def test_a_run_in_this_process_stopped_by_a_signal_names_its_last_checkpoint(tmp_path) -> None:
    """`multigpu train` in one process (no launcher): SIGTERM and Ctrl-C end it with one line and 143 / 130."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        save_dir = tmp_path / signal.Signals(signum).name
        command = [sys.executable, "-m", "multigpu", "train", "--nproc", "1", "--epochs", "100", "--save-dir"]
        with subprocess.Popen(
            [*command, str(save_dir), "--save-every", "1", "--keep-last", "100"],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as process:
            try:
                deadline = time.monotonic() + 120
                while not checkpoint.list_checkpoints(save_dir / "checkpoints") and time.monotonic() < deadline:
                    time.sleep(0.2)
                process.send_signal(signum)
                _, err = process.communicate(timeout=60)
            finally:
                process.kill()
        last = checkpoint.list_checkpoints(save_dir / "checkpoints")[-1]
        assert process.returncode == 128 + signum, err
        assert err.strip().splitlines()[-1] == (
            f"multigpu: stopped by {signal.Signals(signum).name}; the last complete checkpoint is {last}."
        )
        assert "Traceback" not in err


@pytest.mark.parametrize("size", ["0", "-1"])
def test_env_refuses_a_message_size_that_is_not_a_positive_number(size: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["env", "--size-mb", size])
    assert exit_info.value.code == 2
    assert "--size-mb a positive number" in capsys.readouterr().err


SWALLOWS_ITS_STOP = """
import time
from multigpu.launch import stop
stop.STOP_GRACE_S = 1.0
with stop.raising_stopped():
    ready = False
    while True:
        try:  # everything in it, "ready" too: the stop may come as soon as the line is out
            if not ready:
                ready = True
                print("ready", flush=True)
            time.sleep(0.05)
        except BaseException:  # as a finalizer does, or code that catches everything
            pass
"""


def test_a_stop_that_something_swallowed_still_ends_the_process() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", SWALLOWS_ITS_STOP], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout.readline() == "ready\n"
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=30)
        finally:
            process.kill()
    assert process.returncode == 143
    assert err.strip() == "multigpu: stopped by SIGTERM; no checkpoint was completed in this run."


# The verbs that take a strategy, and the name of its setting on each.
STRATEGY_DESTS = {
    "train": "multi_gpu",
    "finetune": "multi_gpu",
    "demo": "strategy",
    "verify": "strategy",
    "simulate": "strategy",
    "bench": "strategies",
}


@pytest.mark.parametrize("verb", STRATEGY_DESTS)
@pytest.mark.parametrize("flag", ["--strategy", "--multi-gpu"])
def test_every_verb_that_takes_a_strategy_takes_both_its_flags(verb: str, flag: str) -> None:
    positionals = ["train.py"] if verb == "verify" else []
    args = config_file.parse_args(build_parser(verb), [verb, flag, "zero3", *positionals])
    assert getattr(args, STRATEGY_DESTS[verb]) == "zero3"


def test_a_flag_no_verb_knows_points_at_that_verbs_help(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse leaves a verb's unknown flags to the top-level parser; the verb's own help is what says its flags."""
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--stratgy", "zero3"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "multigpu finetune: error: unrecognized arguments: --stratgy zero3; see `multigpu finetune --help`.\n"
    )
