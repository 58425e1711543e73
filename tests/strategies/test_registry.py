"""Adding a strategy is one file and one registry line: a toy strategy, written into a copy of the package, runs
under `multigpu demo` and trains as ddp does; nothing else in the copy changed."""

from __future__ import annotations

import filecmp
import shutil
import sys
from pathlib import Path

import pytest

import multigpu
from tests.dist import run_command, run_reference

TOY = '''"""A toy strategy: data parallelism by hand, gradients averaged by an all-reduce per parameter."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from multigpu.core.env import DistEnv
from multigpu.config.layout import REPLICAS
from multigpu.config.precision import PrecisionPlan
from multigpu.strategies.base import Strategy, move_to_device


@dataclass
class Toy(Strategy):
    name = "toy"
    spread = REPLICAS

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        model = move_to_device(model, env)
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(average)
        return model, optimizer


def average(param: torch.Tensor) -> None:
    dist.all_reduce(param.grad)
    param.grad /= dist.get_world_size()
'''
REGISTRY_LINE = '    "deepspeed": "multigpu.strategies.deepspeed:DeepSpeed",\n'


def test_a_strategy_of_one_file_and_one_registry_line_runs_under_demo(tmp_path: Path) -> None:
    original = Path(multigpu.__file__).parent
    copy = tmp_path / "multigpu"
    shutil.copytree(original, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "strategies" / "toy.py").write_text(TOY)
    registry = copy / "strategies" / "__init__.py"
    text = registry.read_text()
    assert REGISTRY_LINE in text
    registry.write_text(text.replace(REGISTRY_LINE, REGISTRY_LINE + '    "toy": "multigpu.strategies.toy:Toy",\n'))
    changed = filecmp.dircmp(original, copy, ignore=["__pycache__"])
    assert (changed.diff_files, changed.left_only, changed.right_only) == ([], [], [])
    assert (changed.subdirs["strategies"].diff_files, changed.subdirs["strategies"].right_only) == (
        ["__init__.py"],
        ["toy.py"],
    )

    def epochs(printed: str) -> list[str]:
        return [line.rsplit("  ", 1)[0] for line in printed.splitlines() if line.startswith("epoch")]

    flags = ["--epochs", "2", "--samples", "512"]
    argv = [sys.executable, "-m", "multigpu", "demo", "--nproc", "2", *flags, "--strategy", "toy"]
    result = run_command(argv, timeout=120, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stdout
    # ddp, what it is compared with, in this package (the copy's demo and ddp are these files, compared above): 2
    # ranks as `multigpu demo --nproc 2` starts, without a second launch's fresh interpreters.
    ddp = run_reference("multigpu.recipes.demo", [*flags, "--strategy", "ddp"], 2)
    # The same averaged gradients as DDP's, bit for bit: a sum of two values, halved, in any order.
    assert len(epochs(result.stdout)) == 2 and epochs(result.stdout) == epochs(ddp)


def test_each_registered_class_is_reachable_by_its_own_name_as_the_guide_shows_it() -> None:
    import multigpu.strategies as strategies

    ddp = strategies.DDP(bucket_cap_mb=50, find_unused_parameters=True, static_graph=False)
    assert (ddp.name, ddp.bucket_cap_mb) == ("ddp", 50)
    assert strategies.FSDP is strategies.strategy_class("zero3") is strategies.strategy_class("fsdp")
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        strategies.Nope  # noqa: B018
