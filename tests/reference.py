"""A tiny model, its data, and the plain one-process loop that every strategy must reproduce.

The reference knows nothing of the Engine: it takes each epoch's permutation of (seed, epoch) (the order the loader
documents, `multigpu.data.shuffle.Permutation`), takes
consecutive slices of `batch_size * world_size * grad_accum_steps` samples as optimizer steps, and averages the
loss over each slice. That is the contract of the Engine's loader and backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.core.lazy import is_dtensor
from multigpu.data.shuffle import Permutation


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(samples, 8, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
    )


@dataclass
class Case:
    strategy: str = "ddp"
    precision: str = "32"
    grad_accum_steps: int = 1
    samples: int = 42
    batch_size: int = 2  # per device
    epochs: int = 2
    max_grad_norm: float = 0.5
    lr: float = 1e-2
    async_save: bool = False
    zero_stage: int | None = None  # strategy deepspeed only
    replicate: int | None = None  # strategy hsdp only
    two_calls: bool = False  # forward + engine.backward as two calls, instead of engine.forward_backward


@dataclass
class Outcome:
    params: dict[str, torch.Tensor]
    grad_norms: list[float]
    loss: float  # of the final model over the whole dataset, in fp32
    seen: list[tuple[int, list[int]]] = field(default_factory=list)  # (epoch, real sample indices) per batch
    steps: int = 0


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    params = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if is_dtensor(param) else param
        params[name.removeprefix("module.")] = tensor.detach().float().cpu().clone()
    return params


def _final_loss(params: dict[str, torch.Tensor], samples: int) -> float:
    model = TinyNet()
    model.load_state_dict(params)
    x, y = dataset(samples).tensors
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


def initial_loss(case: Case) -> float:
    """The loss over the whole dataset of the model every run of `case` starts from (seed 0, as the Engine's and the
    reference's), before any step: what training must move."""
    torch.manual_seed(0)
    model = TinyNet()
    if case.precision == "bf16-true":  # the reference and the Engine hold it in bf16 from the start
        model.to(torch.bfloat16)
    return _final_loss(_full_params(model), case.samples)


def train_engine(
    case: Case, save_to: str | None = None, stop_after: int | None = None, resume_from: str | None = None
) -> Outcome:
    """Trains `case` with the Engine. With `stop_after`, saves to `save_to` after that many optimizer steps and
    stops (a crash); with `resume_from`, continues from that checkpoint. `Outcome.seen` lists the real samples."""
    engine = mg.Engine(
        strategy=case.strategy,
        precision=case.precision,
        grad_accum_steps=case.grad_accum_steps,
        max_grad_norm=case.max_grad_norm,
        seed=0,
        zero_stage=case.zero_stage,
        replicate=case.replicate,
    )
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=case.lr)
    model, optimizer = engine.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    loader = engine.dataloader(dataset(case.samples), batch_size=case.batch_size, shuffle=True)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "steps": 0}
    if resume_from:
        engine.load(resume_from, state)
    norms, seen = [], []
    while loader.epoch < case.epochs:
        epoch = loader.epoch
        for x, y in loader:
            batch = loader.yielded[-1]
            seen.append((epoch, batch.indices[: batch.real]))
            if case.two_calls:
                with engine.accumulate(model):
                    engine.backward(nn.functional.cross_entropy(model(x), y))
            else:
                engine.forward_backward(model, x, y, nn.functional.cross_entropy)
            if engine.step(optimizer):
                scheduler.step()
                norms.append(engine.last_grad_norm)
                state["steps"] += 1
                if state["steps"] == stop_after:
                    engine.save(save_to, state, async_save=case.async_save)
                    engine.wait_for_checkpoint()
                    return Outcome(_full_params(model), norms, float("nan"), seen, state["steps"])
    params = _full_params(model)
    return Outcome(params, norms, _final_loss(params, case.samples), seen, state["steps"])


def train_reference(case: Case, world_size: int) -> Outcome:
    """One process, one optimizer step per global batch, in plain torch."""
    torch.manual_seed(0)
    model = TinyNet()
    if case.precision == "bf16-true":
        model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=case.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    x_all, y_all = dataset(case.samples).tensors
    step_size = case.batch_size * world_size * case.grad_accum_steps
    compute = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(case.precision)
    autocast = torch.autocast("cpu", dtype=compute) if compute else contextlib.nullcontext()
    norms = []
    for epoch in range(case.epochs):
        order = torch.from_numpy(Permutation(case.samples, seed=0, epoch=epoch)(np.arange(case.samples)))
        for start in range(0, case.samples, step_size):
            index = order[start : start + step_size]
            with autocast:
                logits = model(x_all[index].to(next(model.parameters()).dtype))
            nn.functional.cross_entropy(logits.float(), y_all[index]).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_grad_norm).item())
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    params = _full_params(model)
    return Outcome(params, norms, _final_loss(params, case.samples))
