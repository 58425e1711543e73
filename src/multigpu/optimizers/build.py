"""The optimizer a run's settings name, over a model's trainable parameters, and what Muon takes of them."""

from __future__ import annotations

import torch
from torch import nn

from multigpu.config.optimizer import OptimizerSettings
from multigpu.core.errors import UsageError
from multigpu.core.lazy import imported
from multigpu.optimizers.convert import local as _local
from multigpu.parallel.experts import is_experts

#: Where each optimizer of ours is: imported when built, as torchao (the low-bit ones) and DTensor (all) take a
#: second or more to import, which a run of plain AdamW need not pay.
MUON_CLASS = "multigpu.optimizers.muon:Muon"
LOW_BIT_CLASSES = {
    "adamw-bf16": "multigpu.optimizers.low_bit:AdamWBf16",
    "adamw-8bit": "multigpu.optimizers.low_bit:AdamW8bit",
    "adamw-4bit": "multigpu.optimizers.low_bit:AdamW4bit",
}


def build_optimizer(model: nn.Module, settings: OptimizerSettings, lr: float) -> torch.optim.Optimizer:
    """`settings.optimizer` over `model`'s trainable parameters (each once, tied ones included), at `lr`."""
    params = [p for p in model.parameters() if p.requires_grad]
    betas = (settings.beta1, settings.beta2)
    name = settings.optimizer
    if name == "muon":
        return imported(MUON_CLASS)(
            muon_groups(model, settings.muon_params),
            lr=lr,
            weight_decay=settings.weight_decay,
            momentum=settings.momentum,
            ns_steps=settings.muon_ns_steps,
            lr_scale=settings.muon_lr_scale,
            betas=betas,
        )
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=settings.weight_decay)
    return imported(LOW_BIT_CLASSES[name])(params, lr=lr, betas=betas, weight_decay=settings.weight_decay)


def muon_groups(model: nn.Module, which: str) -> list[dict]:
    """[Muon's parameters, AdamW's]: every trainable matrix, and each stack of experts' matrices, to Muon, but with
    `which` "hidden" the embeddings' and the output head's; one sentence refuses a model that leaves Muon none."""
    others = set() if which == "matrices" else {id(p) for p in _embeddings_and_head(model)}
    stacks = {id(p) for module in model.modules() if is_experts(module) for p in module.parameters(recurse=False)}
    muon, adamw = [], []
    for param in (p for p in model.parameters() if p.requires_grad):
        takes = id(param) not in others and (param.dim() == 2 or id(param) in stacks)
        (muon if takes else adamw).append(param)
    if not muon:
        raise UsageError(
            "optimizer muon updates weight matrices, and this model trains none but its embeddings and output head "
            f"({len(adamw)} trainable tensors); use adamw, or muon_params matrices to give Muon those too."
        )
    return [{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}]


def _embeddings_and_head(model: nn.Module) -> list[nn.Parameter]:
    """The embeddings' parameters and the output head's: a Hugging Face model's get_output_embeddings, or else the
    last linear layer (a classifier's head)."""
    found = [p for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
        head = linears[-1] if linears else None
    return found + (list(head.parameters()) if head is not None else [])


def state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of the optimizer's states this rank holds, elements of the parameters they are for on this rank): a
    quantised state counts its codes and scales, a DTensor its local shard; step counters count nothing."""
    held = elements = 0
    for param, state in optimizer.state.items():
        tensors = [value for key, value in state.items() if key != "step" and isinstance(value, torch.Tensor)]
        if not tensors:
            continue
        elements += _local(param).numel()
        for tensor in map(_local, tensors):
            parts = [tensor.codes, tensor.scale] if hasattr(tensor, "codes") else [tensor]
            held += sum(part.numel() * part.element_size() for part in parts)
    return held, elements
