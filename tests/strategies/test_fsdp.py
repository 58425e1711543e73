"""zero2/zero3 (FSDP2) on the models users bring: nested blocks, sharded accumulation, 4-bit weights left as bytes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import multigpu as mg
from multigpu.planner import plan
from multigpu.strategies.fsdp import children_first
from multigpu.transforms.modules import default_units
from tests.dist import run_in_processes
from tests.reference import dataset


class Block(nn.Module):
    def __init__(self, experts: int = 0) -> None:
        super().__init__()
        self.mix = nn.Linear(16, 16)
        # A block with blocks of its own inside (a mixture of experts): units nest.
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(experts)) if experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.mix(x))
        if self.experts is not None:
            x = x + sum(torch.tanh(expert(x)) for expert in self.experts) / len(self.experts)
        return x


class Stages(nn.Module):
    """Blocks in a ModuleList of ModuleLists, and blocks with ModuleLists inside them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.stages = nn.ModuleList([nn.ModuleList([Block(), Block(experts=2)]), nn.ModuleList([Block()])])
        self.heads = nn.ModuleDict({"main": nn.Linear(16, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return self.heads["main"](x)


def test_units_are_the_blocks_however_nested_and_come_children_first() -> None:
    model = Stages()
    units = children_first(model, default_units(model))
    blocks = [model.stages[0][0], model.stages[0][1], model.stages[1][0], model.heads["main"]]
    experts = list(model.stages[0][1].experts)
    assert {id(u) for u in units} == {id(u) for u in blocks + experts}  # never a bare ModuleList
    position = {id(unit): index for index, unit in enumerate(units)}
    for expert in experts:
        assert position[id(expert)] < position[id(model.stages[0][1])]


@dataclass
class AccumCase:
    strategy: str
    grad_accum_steps: int = 1
    unsharded_grad_accum: bool = False


def train_stages(case: AccumCase, batch_size: int) -> dict:
    """One epoch of Stages; the final weights, and the gradient bytes this rank holds after its first micro-step."""
    engine = mg.Engine(
        strategy=case.strategy,
        grad_accum_steps=case.grad_accum_steps,
        unsharded_grad_accum=case.unsharded_grad_accum,
        max_grad_norm=1.0,
    )
    model, optimizer = engine.setup(*_model_and_optimizer())
    held = None
    for x, y in engine.dataloader(dataset(24), batch_size=batch_size):
        with engine.accumulate(model):
            engine.backward(nn.functional.cross_entropy(model(x), y))
        if held is None:
            held = gradient_bytes(model)
        engine.step(optimizer)
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return {"params": params, "grad_bytes": held}


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Stages()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def gradient_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of this rank's sharded gradients, and of the whole ones FSDP keeps aside while it defers a reduction.

    FSDP2 has no public view of the latter: they are read from its per-parameter state, which is what we measure.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = sum((g.to_local() if isinstance(g, DTensor) else g).nbytes for g in grads)
    unsharded = 0
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            for param in group.fsdp_params:
                whole = param.unsharded_accumulated_grad
                if whole is None and hasattr(param, "_unsharded_param"):
                    whole = param._unsharded_param.grad
                unsharded += whole.nbytes if whole is not None else 0
    return {"sharded": sharded, "unsharded": unsharded}


CASES = [
    AccumCase("zero2"),
    AccumCase("zero3"),
    AccumCase("zero2", 2),
    AccumCase("zero3", 2),
    AccumCase("zero3", 2, unsharded_grad_accum=True),
]


def train_all(cases: list[AccumCase]) -> list[dict]:
    return [train_stages(case, batch_size=2) for case in cases]


@pytest.fixture(scope="module")
def two_process_results() -> list[list[dict]]:
    return run_in_processes("tests.strategies.test_fsdp:train_all", 2, timeout=180, cases=CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c) for c in CASES])
def test_nested_blocks_train_like_one_process(two_process_results: list[list[dict]], index: int) -> None:
    case = CASES[index]
    want = train_stages(AccumCase("single", case.grad_accum_steps), batch_size=4)["params"]
    for rank in range(2):
        got = two_process_results[rank][index]["params"]
        for name, param in want.items():
            # fp32: only the order of the sums over ranks and micro-steps differs from one process.
            diff = (got[name] - param).abs().max().item()
            assert diff <= 1e-5, f"{case} rank {rank}: {name} differs from one process by {diff:.2e}"


def test_accumulation_reduce_scatters_every_micro_step_unless_asked_not_to(
    two_process_results: list[list[dict]],
) -> None:
    full = sum(p.numel() * 4 for p in Stages().parameters())

    def planned(unsharded: bool) -> float:
        rows = plan(Stages(), gpus=2, precision="32", grad_accum_steps=2, unsharded_grad_accum=unsharded).strategies
        return next(row for row in rows if row.strategy == "zero3").grads

    assert planned(False) == full / 2 and planned(True) == full
    for rank in range(2):
        sharded = two_process_results[rank][CASES.index(AccumCase("zero3", 2))]["grad_bytes"]
        deferred = two_process_results[rank][CASES.index(AccumCase("zero3", 2, True))]["grad_bytes"]
        # Default: after the first micro-step this rank already holds only its shard (padding aside).
        assert sharded["unsharded"] == 0 and sharded["sharded"] == pytest.approx(planned(False), rel=0.1)
        # unsharded_grad_accum: nothing reduced yet, the whole gradient kept aside, as the planner counts it.
        assert deferred["sharded"] == 0 and deferred["unsharded"] == planned(True)


def forward_weight_bytes(precision: str) -> dict:
    """zero3 QLoRA: the bytes every 4-bit layer computes with in forward, against those it was quantised to."""
    from bitsandbytes.nn import Linear4bit

    from multigpu.models.lm_models import load_model

    engine = mg.Engine(strategy="zero3", precision=precision)
    model = load_model("tiny", "qlora", precision=precision)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear4bit)}
    quantised = {name: m.weight.detach().clone().view(torch.uint8) for name, m in layers.items()}
    seen: dict[str, torch.Tensor] = {}

    def record(name: str, module: nn.Module) -> None:
        seen.setdefault(name, module.weight.detach().clone())

    for name, module in layers.items():
        module.register_forward_pre_hook(lambda module, args, name=name: record(name, module))
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, _ = engine.setup(model, torch.optim.AdamW(trainable))
    model(input_ids=torch.tensor([[1, 520, 2138, 314, 29, 905]]))
    return {
        "layers": len(layers),
        "dtypes": {str(t.dtype) for t in seen.values()},
        "changed": [name for name, t in seen.items() if not torch.equal(t.view(torch.uint8), quantised[name])],
    }


def forward_weight_bytes_all(precisions: list[str]) -> list[dict]:
    return [forward_weight_bytes(precision) for precision in precisions]


def test_4bit_weights_reach_forward_as_quantised_under_mixed_precision() -> None:
    from multigpu.models.lm_models import QUANT_STORAGE, model_dir

    model_dir("tiny")  # build the cache here, not in two workers at once
    precisions = ["fp16-mixed", "bf16-mixed"]
    results = run_in_processes(
        "tests.strategies.test_fsdp:forward_weight_bytes_all", 2, timeout=180, precisions=precisions
    )
    for rank in range(2):
        for precision, found in zip(precisions, results[rank], strict=True):
            assert found["layers"] == 2 * 7, found
            assert found["dtypes"] == {str(QUANT_STORAGE)}, f"{precision}: cast to {found['dtypes']}"
            assert found["changed"] == [], f"{precision} rank {rank}: {found['changed'][:3]} changed"
