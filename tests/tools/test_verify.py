"""`multigpu verify` passes correct scripts under every strategy and fails the classic mistakes at step 1."""

import json
from pathlib import Path

import pytest
import torch

from multigpu.tools.verify import TOLERANCES, Verdict, param_differences, print_verdict
from tests.dist import multigpu, refusal

SCRIPT = "tests/scripts/next_token.py"


def verify(*flags: str, bug: str = "none", script_flags: tuple[str, ...] = ()) -> tuple[int, dict]:
    result = multigpu("verify", "--json", "--steps", "4", *flags, SCRIPT, "--bug", bug, *script_flags, timeout=240)
    assert result.returncode in (0, 1), result.stdout
    report = json.loads(result.stdout[result.stdout.index("{\n") :])
    return result.returncode, report


@pytest.mark.parametrize(("strategy", "precision"), [("deepspeed", "bf16-mixed"), ("tp", "32"), ("pp", "32")])
def test_passes_a_correct_script(strategy: str, precision: str) -> None:
    """Under tp and pp the two processes share each batch: the reference accumulates 1 batch per step, not 2;
    DeepSpeed wraps model and optimizer its own way, here in bf16-mixed, which both runs take and which compares
    them with its own tolerance (DeepSpeed's fp32 steps match one process's to 1e-5 in test_deepspeed.py), and
    its two processes split each global batch 3:1 (batch_shares). (Data parallelism passes below, its
    per-process batch taken from a fixed global batch; ddp, zero1 and zero2 differ from zero3 there only in what
    test_equivalence checks.)"""
    shares = ("--batch-shares", "3,1") if strategy == "deepspeed" else ()
    code, report = verify("--strategy", strategy, "--precision", precision, *shares)
    assert code == 0 and report["passed"], report
    assert report["strategy"] == strategy and [s["step"] for s in report["steps"]] == [1, 2, 3, 4]
    assert report["first_divergence"] is None and report["initial_param_diff"] == 0
    assert report["loss_tolerance"] == TOLERANCES[precision][0] == {"32": 1e-4, "bf16-mixed": 3e-2}[precision]
    assert max(s["relative_diff"] for s in report["steps"]) <= report["loss_tolerance"]


@pytest.mark.parametrize(
    "flags",
    [
        # Sequences of 2 to 15 tokens: the compiled layers see new lengths, compile once more, then run dynamic
        # (compiled zero2 and zero3 against one process: tests/strategies/test_model_parallel.py).
        [
            *("--strategy", "ddp", "--activation-checkpointing", "offload", "--grad-compression", "bf16"),
            *("--compile", "--compile-backend", "aot_eager"),
        ],
        ["--strategy", "zero2", "--float8", "tensorwise", "--activation-checkpointing", "full"],
    ],
    ids=["ddp-compile-offload-bf16-gradients", "zero2-float8-full"],
)
def test_passes_under_the_speed_settings(flags: list[str]) -> None:
    """Both runs compile, checkpoint and train in float8 alike; gradients reduced in bf16 take bf16's tolerance."""
    code, report = verify(*flags, script_flags=("--width", "32"))  # float8 takes dimensions of multiples of 16
    assert code == 0 and report["passed"], report


@pytest.mark.parametrize("bug", ["dropout", "token-mean"])
def test_fails_per_rank_randomness_and_per_rank_token_means(bug: str) -> None:
    code, report = verify("--strategy", "ddp", bug=bug)
    assert code == 1 and not report["passed"]
    assert report["first_divergence"] == 1 and report["reason"] == "the loss diverged at step 1"
    assert report["steps"][0]["relative_diff"] > 5 * report["loss_tolerance"]
    # Only what verify saw is blamed: the dropout module; a token mean it cannot see, and says so.
    assert "both runs' first step read the same samples" in report["checked"]
    if bug == "dropout":
        assert [cause.split(" (")[0] for cause in report["causes"]] == ["the model has dropout"]
    else:
        assert report["causes"] == [] and "no BatchNorm or dropout" in " ".join(report["checked"])
        assert any("engine.backward got no count=" in blind for blind in report["unchecked"])


NANOGPT = "docs/examples/nanogpt_train.py"


def test_passes_the_nanogpt_shaped_example_that_fixes_the_global_batch_stepping_with_muon(tmp_path: Path) -> None:
    """The porting guide's example: a tied GPT-2-shaped model, random windows, global_batch_size=16 of 4 per device,
    so the one-process reference accumulates 4 micro-batches where each of 2 processes accumulates 2 (2x theirs, by
    the Engine's own derivation, not verify's); evaluation and checkpoints run on every rank inside the steps.
    Under zero3, which holds the tied embedding and head in one FSDP unit, and with its AdamW swapped for
    engine.optimizer under optimizer muon, as a user would: zero3 shards each matrix, Muon gathers it whole; the
    comparison takes Muon's tolerance (verify.py: OPTIMIZER_TOLERANCES). (The example as written trains under zero3
    and resumes at another world size in tests/launch/test_ecosystem_scripts.py.)"""
    text = Path(NANOGPT).read_text()
    own = "torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)"
    assert own in text and "seed=1337)" in text
    text = text.replace(own, "engine.optimizer(model, args.learning_rate)")
    text = text.replace("seed=1337)", 'seed=1337, optimizer="muon", beta2=0.95, weight_decay=0.1)')
    script = tmp_path / "nanogpt_muon.py"
    script.write_text(text)
    (tmp_path / "nanogpt_model.py").write_text(Path(NANOGPT).with_name("nanogpt_model.py").read_text())
    result = multigpu(
        "verify", "--json", "--steps", "3", "--strategy", "zero3", str(script), "--max-iters", "3",
        "--eval-interval", "2", "--out-dir", str(tmp_path / "out"), timeout=240,
    )  # fmt: skip
    report = json.loads(result.stdout[result.stdout.index("{\n") :])
    assert result.returncode == 0 and report["passed"], report
    assert report["samples_per_step"] == 16 and report["reference_grad_accum"] == 2
    assert report["strategy"] == "zero3" and [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert report["param_tolerance"] == 0.15


def test_fails_a_dataloader_that_every_rank_reads_whole() -> None:
    code, report = verify("--strategy", "ddp", bug="plain-loader")
    assert code == 1 and report["first_divergence"] == 1
    assert len(report["causes"]) == 1 and report["causes"][0].startswith("every process read the same samples")


def test_dp_without_gpus_is_one_sentence() -> None:
    printed = refusal("verify", "--strategy", "dp", SCRIPT)
    assert printed.count("\n") == 1 and "--strategy dp splits each batch over the GPUs of one process" in printed
    printed = refusal("verify", "--strategy", "dp", "--nproc", "2", SCRIPT)
    assert "drop --nproc" in printed and printed.count("\n") == 1, printed


def test_a_usage_error_in_the_script_is_printed_once() -> None:
    """`single` in 2 processes: the Engine refuses on both ranks; verify prints the sentence once, exit 2."""
    result = multigpu("verify", "--strategy", "single", "--steps", "1", SCRIPT, timeout=120)
    assert result.returncode == 2, result.stdout
    assert result.stdout.splitlines() == [
        "multigpu: error: Strategy single runs in one process, but 2 were launched and would each train alone; "
        "launch one process, or use ddp/zero1/zero2/zero3."
    ]


def test_refuses_one_process_compared_with_itself() -> None:
    assert "--nproc 1 compares one process with itself" in refusal("verify", "--nproc", "1", SCRIPT)


def test_one_process_under_a_strategy_against_the_plain_run() -> None:
    """What one GPU can check: the strategy's wrapping and precision path in a group of one."""
    code, report = verify("--nproc", "1", "--strategy", "zero3")
    assert code == 0 and report["passed"] and report["strategy"] == "zero3", report


def test_a_warm_up_sized_update_is_compared_beyond_the_parameters_rounding() -> None:
    """An lr warm-up's step moves parameters of about 1 by 1e-6: the N-process run rounding some of them one unit
    in the last place (1.2e-7) the other way is 0.12 of that update, far past fp32's 1e-3 of it, though nothing is
    wrong. A bug's difference, a share of the update itself, still fails."""
    start = torch.linspace(-1, 1, 1001)
    update = torch.full_like(start, 1e-6)
    final = start + update
    rounded = final.clone()
    rounded[::50] = torch.nextafter(final[::50], torch.full_like(final[::50], 2.0))  # one ulp up
    assert float((rounded - final).abs().max() / update.max()) > 100 * TOLERANCES["32"][1]  # the bound alone failed
    initial, diffs = param_differences(({"w": start}, {"w": final}), ({"w": start}, {"w": rounded}), "32")
    assert initial == 0 and diffs["w"] == 0
    buggy = final + 0.5 * update  # e.g. one process's gradient counted 1.5 times
    _, diffs = param_differences(({"w": start}, {"w": final}), ({"w": start}, {"w": buggy}), "32")
    assert diffs["w"] > 0.4


def verdict_of(losses: list[tuple[float, float]]) -> Verdict:
    steps = [
        {"step": i + 1, "loss_1": a, "loss_n": b, "relative_diff": abs(a - b) / a} for i, (a, b) in enumerate(losses)
    ]
    first = next((s["step"] for s in steps if s["relative_diff"] > 1e-4), None)
    return Verdict(
        passed=first is None,
        nproc=2,
        strategy="ddp",
        precision="32",
        loss_tolerance=1e-4,
        param_tolerance=1e-3,
        samples_per_step=8,
        reference_grad_accum=2,
        steps=steps,
        first_divergence=first,
        initial_param_diff=0.0,
        param_diff=0.0,
        worst_param="weight",
        reason="" if first is None else f"the loss diverged at step {first}",
        causes=[],
        checked=[],
        unchecked=[],
    )


def header_cells(output: str) -> list[str]:
    """The cells of the table's header row (rich draws it between ┃ characters)."""
    header = next(line for line in output.splitlines() if line.startswith("┃"))
    return [cell.strip() for cell in header.strip("┃").split("┃")]


def test_the_table_has_no_empty_column(capsys: pytest.CaptureFixture) -> None:
    """A passing run's table has no column for steps beyond the tolerance; a failing one names it and marks them."""
    print_verdict(verdict_of([(1.0, 1.0), (0.9, 0.9)]), as_json=False)
    passed = capsys.readouterr().out
    assert header_cells(passed) == ["step", "loss, 1 process", "loss, 2 processes", "relative difference"], passed
    print_verdict(verdict_of([(1.0, 1.0), (0.9, 0.8), (0.8, 0.7)]), as_json=False)
    failed = capsys.readouterr().out
    assert header_cells(failed)[-1] == "beyond tolerance", failed
    rows = [line for line in failed.splitlines() if line.startswith("│")]
    assert [row.strip("│").split("│")[-1].strip() for row in rows] == ["no", "first divergence", "yes"], failed


NO_ENGINE = """
# Plain torch, no Engine, and long: 100,000 steps of at least 10 ms each.
import time
import torch
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100_000):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(0.01)
"""


def test_a_script_without_an_engine_is_refused_at_its_first_step(tmp_path: Path) -> None:
    """Not after it ran to its end: its first optimizer step already shows that there is nothing to compare.
    (Each process refuses alike: one process is enough to show it, and cheaper.)"""
    script = tmp_path / "plain.py"
    script.write_text(NO_ENGINE)
    result = multigpu("verify", "--nproc", "1", "--strategy", "ddp", "--steps", "2", str(script), timeout=90)
    assert result.returncode == 2, result.stdout
    assert result.stdout.splitlines() == [
        f"multigpu: error: {script} took an optimizer step without a multigpu Engine, and bench and verify measure "
        "only scripts that train through one; build an Engine in it (docs/guide.md, from one GPU to many), or run "
        "it as it is with multigpu run."
    ]


def test_passes_the_finetune_recipe_under_the_chunked_loss_and_context_and_expert_parallelism(tmp_path: Path) -> None:
    """The loss setting takes effect through engine.lm_loss, which the finetune recipe uses (a script's own loss
    would be refused at its first step); the 2 processes also split each sequence (cp 2), so the chunked loss runs
    on each rank's half of the tokens and verify compares a cp run with the whole one; and the model is a mixture
    of experts spread over them (ep 2), whose router load-balancing loss counts the tokens of both."""
    from tests.recipes.test_finetune import write_text

    recipe = ["-m", "multigpu.recipes.finetune", "--model", "tiny-moe", "--method", "full", "--seq-len", "32"]
    recipe += ["--data", write_text(tmp_path / "text.txt"), "--batch-size", "2", "--save-dir", str(tmp_path / "run")]
    result = multigpu(
        "verify",
        "--json",
        "--steps",
        "2",
        "--strategy",
        "zero3",
        "--cp-size",
        "2",
        "--ep-size",
        "2",
        "--loss",
        "chunked",
        *recipe,
        timeout=240,
    )
    report = json.loads(result.stdout[result.stdout.index("{\n") :])
    assert result.returncode == 0 and report["passed"], report
