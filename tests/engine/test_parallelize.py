"""engine/parallelize.py: the model transforms run in the order docs/architecture.md states, whatever the strategy
(each step's own work is tested with the strategies that take it: tests/strategies/test_model_parallel.py)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from multigpu.config.layout import ALONE, ParallelDims
from multigpu.config.precision import Precision, PrecisionPlan
from multigpu.core.env import DistEnv
from multigpu.engine import parallelize as plan_module
from multigpu.transforms.modules import default_units

#: The steps in the documented order, each as the function the plan calls for it.
STEPS = {
    "Liger": "apply_liger",
    "float8": "convert_linears",
    "tensor parallelism": "split_layers",
    "context-parallel attention": "use_context_attention",
    "expert parallelism": "spread_experts",
    "activation checkpointing": "recompute_blocks",
    "compile": "compile_blocks",
    "pipeline stages": "cut_stages",
    "expert data parallelism": "hold_experts",
    "data-parallel wrapping": "setup",
}
#: The steps the strategy itself takes (its methods); the plan's own functions are the others.
STRATEGY_STEPS = ("cut_stages", "setup")
ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


class Recorded:
    """A strategy with a tp dimension and ep, whose hooks only record that they ran."""

    name, mesh_dims, builds_on_meta, spread = "recorded", ("tp",), False, ALONE
    layout = ParallelDims(shard=2, tp=2, ep=2)

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.mesh = SimpleNamespace(mesh_dim_names=("tp",))

    def splits_layers(self) -> bool:
        return True

    def gathers_weights(self) -> bool:
        return False

    def unit_blocks(self, model: nn.Module) -> list[nn.Module]:
        return default_units(model)

    def sharded_modules(self, model: nn.Module) -> list[nn.Module]:
        return self.unit_blocks(model)

    def cut_stages(self, model: nn.Module, optimizer: Any, env: DistEnv) -> tuple[nn.Module, Any]:
        self.order.append("cut_stages")
        return model, optimizer

    def build_mesh(self, env: DistEnv) -> Any:
        self.order.append("build_mesh")
        return self.mesh

    def make_alike(self, model: nn.Module, env: DistEnv) -> bool:
        self.order.append("make_alike")
        return True

    def setup(self, model: nn.Module, optimizer: Any, env: DistEnv, plan: PrecisionPlan) -> tuple[nn.Module, Any]:
        self.order.append("setup")
        return model, optimizer


def test_the_plan_applies_every_step_once_in_the_documented_order(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    for function in STEPS.values():
        if function not in STRATEGY_STEPS:
            monkeypatch.setattr(plan_module, function, lambda *_, name=function, **__: order.append(name))
    monkeypatch.setattr(plan_module, "mixture_of_experts", lambda *_: None)
    config = SimpleNamespace(
        liger=True,
        float8="tensorwise",
        sync_batchnorm=False,
        activation_checkpointing="full",
        compile=True,
        compile_backend="aot_eager",
    )
    cp = SimpleNamespace(join=lambda mesh: order.append("cp.join"))
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    plan = PrecisionPlan(Precision("32"), None, torch.float32, None)
    strategy = Recorded(order)
    plan_module.parallelize(strategy, model, None, DistEnv(), plan, config, (None, None), print, cp)
    # The mesh first (tp, cp and ep lay their tensors out on it); every rank holds rank 0's weights before tp.
    assert order[:3] == ["build_mesh", "apply_liger", "convert_linears"]
    assert order.index("make_alike") < order.index("split_layers")
    assert order.index("cp.join") < order.index("use_context_attention")
    assert [step for step in order if step in STEPS.values()] == list(STEPS.values())


def test_the_architecture_page_lists_the_steps_in_the_plans_order() -> None:
    text = ARCHITECTURE.read_text()
    section = re.search(r"^## The parallelize order$(.*?)(?=^## )", text, flags=re.MULTILINE | re.DOTALL)
    assert section is not None, "docs/architecture.md has no section 'The parallelize order'"
    items = re.findall(r"^\d+\. (.+)$", section.group(1), flags=re.MULTILINE)
    assert [next((step for step in STEPS if item.startswith(step)), item) for item in items] == list(STEPS)
    assert "engine/parallelize.py" in section.group(1)
