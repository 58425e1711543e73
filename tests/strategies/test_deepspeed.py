"""Strategy deepspeed: ZeRO stages 1-3 through DeepSpeed compute what one process computes, and their
checkpoints load at any world size, into any strategy, and export like every other strategy's."""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import multigpu as mg
from multigpu import checkpoint
from multigpu.config.precision import Precision
from multigpu.core.errors import UsageError
from multigpu.strategies.deepspeed import DeepSpeed
from multigpu.transforms.modules import give_back_freed_memory
from tests.checkpoint.test_checkpoint import GLOBAL_BATCH, SAMPLES, STOP, assert_resumed_exactly
from tests.dist import refusal, run_command, run_each_in_processes, run_in_processes
from tests.engine.test_init_module import COMPARED_WIDTH, SEED, WIDTH, Net, one_step, rss_bytes
from tests.reference import Case, Outcome, TinyNet, dataset, train_engine, train_reference
from tests.strategies.test_equivalence import assert_matches

MATRIX = [Case("deepspeed", "32", accum, zero_stage=stage) for stage, accum in itertools.product((1, 2, 3), (1, 4))] + [
    Case("deepspeed", "bf16-mixed", 2, zero_stage=stage) for stage in (1, 3)
]


@pytest.fixture(scope="module")
def two_process_outcomes() -> list[list[Outcome]]:
    return run_each_in_processes("tests.reference:train_engine", 2, [{"case": case} for case in MATRIX], timeout=300)


@pytest.mark.parametrize(
    "index", range(len(MATRIX)), ids=[f"stage{c.zero_stage}-{c.precision}-accum{c.grad_accum_steps}" for c in MATRIX]
)
def test_two_processes_match_one(two_process_outcomes: list[list[Outcome]], index: int) -> None:
    case = MATRIX[index]
    rank0, rank1 = (outcomes[index] for outcomes in two_process_outcomes)
    for name in rank0.params:
        assert (rank0.params[name] == rank1.params[name]).all(), f"{case}: ranks differ in {name}"
    assert_matches(case, rank0, train_reference(case, world_size=2))


def run(case: Case, nproc: int, **kwargs) -> list[Outcome]:
    return run_in_processes("tests.reference:train_engine", nproc, timeout=180, case=case, **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Outcome]]:
    """2 processes under DeepSpeed ZeRO-3 train 4 steps of epoch 0, save and stop."""
    path = tmp_path_factory.mktemp("ckpt") / "step-4"
    case = Case("deepspeed", samples=SAMPLES, batch_size=GLOBAL_BATCH // 2, zero_stage=3)
    return path, run(case, 2, save_to=str(path), stop_after=STOP)


@pytest.mark.parametrize(
    ("strategy", "stage", "nproc"), [("deepspeed", 1, 3), ("ddp", None, 1)], ids=["deepspeed1-3proc", "ddp-1proc"]
)
def test_a_deepspeed_checkpoint_resumes_anywhere(saved, strategy: str, stage: int | None, nproc: int) -> None:
    path, first = saved
    case = Case(strategy, samples=SAMPLES, batch_size=GLOBAL_BATCH // nproc, zero_stage=stage)
    assert_resumed_exactly(first, run(case, nproc, resume_from=str(path)))


def save_then_resume(first: Case, second: Case, path: str) -> tuple[Outcome, Outcome]:
    """Runs in each worker: `first` trains, saves at `path` and stops; `second`, a new Engine, resumes from it."""
    return train_engine(first, save_to=path, stop_after=STOP), train_engine(second, resume_from=path)


def test_a_zero3_checkpoint_resumes_under_deepspeed(tmp_path: Path) -> None:
    first = Case("zero3", samples=SAMPLES, batch_size=GLOBAL_BATCH // 2)
    second = Case("deepspeed", samples=SAMPLES, batch_size=GLOBAL_BATCH // 2, zero_stage=2)
    ranks = run_in_processes(
        "tests.strategies.test_deepspeed:save_then_resume", 2, timeout=240, first=first, second=second,
        path=str(tmp_path / "step-4"),
    )  # fmt: skip
    assert_resumed_exactly([rank[0] for rank in ranks], [rank[1] for rank in ranks])


def test_export_consolidates_a_deepspeed_checkpoint(saved, tmp_path: Path) -> None:
    """In this process (`multigpu export` as typed, in a process of its own: the README's, in tests/test_docs.py)."""
    from multigpu.cli import main

    path, first = saved
    assert main(["export", str(path), str(tmp_path / "model.safetensors")]) == 0
    params = checkpoint.full_model_state(path)
    assert set(params) == set(first[0].params)
    for name, tensor in params.items():
        assert (tensor == first[0].params[name]).all(), name
    TinyNet().load_state_dict(params)


def config(tmp_path: Path, options: dict, settings: dict | None = None, **strategy) -> dict:
    file = tmp_path / "ds.json"
    file.write_text(json.dumps(settings or {}))
    strategy = DeepSpeed(**options, **strategy, deepspeed_config=str(file))
    return strategy.config(strategy.precision_plan(Precision("32"), torch.device("cpu")))


def test_a_users_config_is_kept_and_completed(tmp_path: Path) -> None:
    settings = {"zero_optimization": {"stage": 3, "overlap_comm": False}, "train_batch_size": "auto", "bf16": "auto"}
    built = config(tmp_path, {"offload_optimizer": True}, settings, max_grad_norm=1.0)
    assert built["zero_optimization"] == {"stage": 3, "overlap_comm": False, "offload_optimizer": {"device": "cpu"}}
    assert built["gradient_clipping"] == 1.0 and built["gradient_accumulation_steps"] == 1
    assert "bf16" not in built and "train_batch_size" not in built


@pytest.mark.parametrize(
    ("options", "settings", "message"),
    [
        ({}, {"gradient_accumulation_steps": 4}, "remove it and set the Engine's grad_accum_steps"),
        ({}, {"bf16": {"enabled": True}}, "remove it and set the Engine's precision"),
        ({"zero_stage": 1}, {"zero_optimization": {"stage": 3}}, "zero_stage 1 contradicts"),
        ({}, {"zero_optimization": {"stage": 0}}, "use ddp for 0"),
        ({"offload_param": True, "zero_stage": 2}, {}, "offload_param needs ZeRO stage 3"),
    ],
)
def test_conflicts_are_refused(tmp_path: Path, options: dict, settings: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        config(tmp_path, options, settings)


def test_cli_refuses_what_deepspeed_cannot_do(tmp_path: Path) -> None:
    printed = refusal("train", "--multi-gpu", "deepspeed", "--precision", "bf16-true", "--save-dir", str(tmp_path))
    assert "use precision bf16-mixed" in printed, printed
    printed = refusal("train", "--multi-gpu", "ddp", "--zero-stage", "2", "--save-dir", str(tmp_path))
    assert "is an option of strategy deepspeed" in printed, printed


def test_without_deepspeed_one_sentence_says_how_to_install_it() -> None:
    code = "import sys; sys.modules['deepspeed'] = None; import multigpu as mg; mg.Engine(strategy='deepspeed')"
    result = run_command([sys.executable, "-c", code])
    assert result.returncode == 1 and "pip install 'multigpu[deepspeed]'" in result.stdout, result.stdout


def train_with_offload(stage: int, offload_optimizer: bool, offload_param: bool) -> dict:
    """One epoch of TinyNet under DeepSpeed; returns the trained weights (runs in each worker)."""
    engine = mg.Engine(
        strategy="deepspeed",
        zero_stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        max_grad_norm=0.5,
    )
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.setup(model, optimizer)
    for x, y in engine.dataloader(dataset(42), batch_size=2):
        engine.backward(nn.functional.cross_entropy(model(x), y))
        engine.step(optimizer)
    return model_weights(engine, model)


def model_weights(engine: mg.Engine, model: nn.Module) -> dict:
    return engine.full_state_dict(model)  # whole on rank 0


def offload_variants() -> list[dict]:
    return [train_with_offload(*variant) for variant in ((2, False, False), (2, True, False), (3, True, True))]


def test_offload_trains_the_same_model() -> None:
    """ZeRO-Offload moves states to CPU memory and the step there; the arithmetic must not change."""
    plain, offload_optimizer, offload_both = run_in_processes(
        "tests.strategies.test_deepspeed:offload_variants", 2, timeout=240
    )[0]
    for name, weight in plain.items():
        # The clip norm is summed in another order per offload path (measured: weights then differ by ~3e-8). One
        # Adam step moves a weight by about the learning rate, 1e-2: a wrong step, norm or scale is far above 1e-6.
        for other in (offload_optimizer, offload_both):
            torch.testing.assert_close(
                other[name], weight, atol=1e-6, rtol=0, msg=lambda text, name=name: f"{name}: {text}"
            )
    torch.manual_seed(0)  # the Engine's seed: the weights training started from
    initial = TinyNet().state_dict()
    assert not any(torch.equal(plain[name], weight) for name, weight in initial.items()), "nothing trained"


ONE_STEP = """
import torch
import multigpu as mg
engine = mg.Engine(strategy="deepspeed", zero_stage=2)
model = torch.nn.Linear(4, 2)
model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
engine.backward(model(torch.ones(2, 4)).sum())
engine.step(optimizer)
print("stepped on rank", engine.rank, "of", engine.world_size, "with launcher", engine.env.launcher)
"""


@pytest.mark.parametrize(
    ("launcher", "variables"),
    [
        ("slurm", {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}),
        ("none", {}),
    ],
)
def test_deepspeed_runs_under_srun_and_without_a_launcher(launcher: str, variables: dict) -> None:
    """srun and a plain `python script.py` set no LOCAL_RANK, which DeepSpeed's engine insists on."""
    result = run_command([sys.executable, "-c", ONE_STEP], env=variables, timeout=120)
    assert result.returncode == 0 and f"stepped on rank 0 of 1 with launcher {launcher}" in result.stdout, result.stdout


def checkpoint_shares(stage: int) -> dict:
    """What this rank contributes to a checkpoint under DeepSpeed, and what rank 0 exports."""
    engine = mg.Engine(strategy="deepspeed", zero_stage=stage)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.setup(model, optimizer)
    x, y = dataset(4).tensors
    engine.backward(nn.functional.cross_entropy(model(x), y))
    engine.step(optimizer)
    weights = engine.model_state_dict(model)
    states = engine._strategy.optimizer_state_dict(model, optimizer)["state"]
    return {
        "weights": set(weights),
        "states": set(states),
        "devices": {str(t.device) for t in weights.values()}
        | {str(t.device) for s in states.values() for t in s.values()},
        "export": {name: tuple(t.shape) for name, t in engine.full_state_dict(model).items()},
    }


def test_each_rank_assembles_only_its_share_of_a_checkpoint() -> None:
    stages = [2, 3]
    calls = [{"stage": stage} for stage in stages]
    ranks = run_each_in_processes("tests.strategies.test_deepspeed:checkpoint_shares", 2, calls, timeout=180)
    names = {name for name, _ in TinyNet().named_parameters()}
    for index, stage in enumerate(stages):
        first, second = ranks[0][index], ranks[1][index]
        for part in ("weights", "states"):
            assert not first[part] & second[part], f"stage {stage}: {part} kept twice"
            assert first[part] | second[part] == names, f"stage {stage}: {part} incomplete"
        assert first["devices"] == second["devices"] == {"cpu"}
        assert first["export"] == {name: tuple(p.shape) for name, p in TinyNet().named_parameters()}
        assert second["export"] == {}


def peak_growth(build: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """What `build(*args)` returns, and the process's peak RSS growth while it ran."""
    give_back_freed_memory()  # or what earlier work freed would serve the build unseen
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to what the process holds now
    before = rss_bytes("VmRSS")
    return build(*args), rss_bytes("VmHWM") - before


def set_up(engine: mg.Engine, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return engine.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))


def differing(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are not bitwise `expected`'s (none off rank 0, where full states are empty)."""
    return [name for name, tensor in expected.items() if not torch.equal(state[name], tensor)]


def partitioned(model: nn.Module) -> bool:
    """Whether zero.Init holds every parameter of `model` as this rank's partition (nothing whole)."""
    return all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())


def zero3_under_init_module(folder: str) -> dict:
    """ZeRO-3 with the model built under engine.init_module, then the same run built plainly; returns the names of
    the tensors that differ where they must not, and each full-size build's peak memory growth on this rank."""
    warm = mg.Engine(strategy="deepspeed", zero_stage=3)
    with warm.init_module():  # DeepSpeed's and gloo's one-time costs, paid before anything is measured
        small = Net(width=8, blocks=2)
    checks = {"stage 3 partitions": partitioned(small)}
    warm.setup(small, torch.optim.AdamW(small.parameters()))
    with mg.Engine(strategy="deepspeed", zero_stage=2).init_module():
        checks["stage 2 builds whole"] = not any(hasattr(p, "ds_id") for p in Net(width=8, blocks=2).parameters())
    with mg.Engine(strategy="deepspeed", zero_stage=3, precision="bf16-mixed").init_module():
        checks["bf16-mixed builds fp32"] = {p.dtype for p in Net(width=8, blocks=2).parameters()}
    runs, growth = {}, {}
    for meta in (True, False):
        # What building the full-size Net holds; the runs compared are of a narrow one (the bits do not depend on
        # the width, and a full-size setup, its steps and gathered states cost seconds each).
        with mg.Engine(strategy="deepspeed", zero_stage=3).init_module() if meta else contextlib.nullcontext():
            growth[meta] = peak_growth(Net)[1]
        engine = mg.Engine(strategy="deepspeed", zero_stage=3, seed=SEED)
        with engine.init_module() if meta else contextlib.nullcontext():
            model = Net(width=COMPARED_WIDTH)
        model, optimizer = set_up(engine, model)
        run = {"initial": engine.full_state_dict(model)}
        for _ in range(2):
            one_step(engine, model, optimizer)
        run["stepped"] = engine.full_state_dict(model)
        if meta:  # a round trip: save, step on, load back; the step after it must be the plain run's third
            state = {"model": model, "optimizer": optimizer}
            engine.save(Path(folder) / "step-2", state)
            one_step(engine, model, optimizer)
            engine.load(Path(folder) / "step-2", state)
            run["reloaded"] = engine.full_state_dict(model)
        one_step(engine, model, optimizer)
        run["third"] = engine.full_state_dict(model)
        runs[meta] = run
    built, plain = runs[True], runs[False]
    torch.manual_seed(SEED)
    one_process = Net(width=COMPARED_WIDTH).state_dict() if dist.get_rank() == 0 else {}
    return {
        "checks": checks,
        "growth": growth,
        "initial": differing(built["initial"], one_process) + differing(plain["initial"], one_process),
        "stepped": differing(built["stepped"], plain["stepped"]),
        "reloaded": differing(built["reloaded"], built["stepped"]),
        "third": differing(built["third"], plain["third"]),
        "untrained": [name for name in one_process if torch.equal(built["third"][name], one_process[name])],
    }


def test_zero3_under_init_module_partitions_while_building_and_trains_the_same(tmp_path: Path) -> None:
    """deepspeed.zero.Init under engine.init_module: each rank holds its partition of the model and one layer while
    building it, then setup, training and a checkpoint round trip are bitwise those of a plain build."""
    ranks = run_in_processes(
        "tests.strategies.test_deepspeed:zero3_under_init_module", 2, timeout=240, folder=str(tmp_path)
    )
    first = ranks[0]
    expected = {"stage 3 partitions": True, "stage 2 builds whole": True, "bf16-mixed builds fp32": {torch.float32}}
    assert first["checks"] == expected  # the Engine's bf16-mixed is autocast, so DeepSpeed keeps fp32 weights
    # Bitwise: zero.Init broadcasts rank 0's values, which are the one-process build's (same seed, same order),
    # and a plain build's are too; the same partitions then train, save and load the same.
    assert first["initial"] == [], "initial weights differ from a one-process build"
    for check in ("stepped", "reloaded", "third"):
        assert first[check] == [], f"{check}: {first[check][:3]} differ"
    assert first["untrained"] == [], f"{first['untrained'][:3]} never changed"
    with torch.device("meta"):
        model_bytes = sum(t.numel() * t.element_size() for t in Net().state_dict().values())  # 128.4 MiB, fp32
    layer_bytes = WIDTH * WIDTH * 4 + 2 * WIDTH * 4  # one block, the largest layer zero.Init builds whole
    # Its partition of everything, one layer being built, and 8 MiB for the allocator and torch's own buffers
    # (measured: 69 MiB on each rank, where a plain build grows by 128.4 MiB).
    bound = model_bytes / 2 + layer_bytes + 8 * 2**20
    for rank, result in enumerate(ranks):
        built, plain = result["growth"][True], result["growth"][False]
        assert built <= bound, f"rank {rank} grew by {built / 2**20:.1f} MiB building, over {bound / 2**20:.1f} MiB"
        # A plain build holds the whole model (so the bound above can fail); a few freed small blocks are reused.
        assert plain >= model_bytes - 2**20, f"a plain build grew rank {rank} by only {plain / 2**20:.1f} MiB"
