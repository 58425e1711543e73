"""Muon that makes the update a single process makes, however the weights are split across ranks.

Muon orthogonalises each weight matrix's Nesterov momentum with a few Newton-Schulz iterations (torch's own, in
bfloat16) and steps along the result; the other parameters (embeddings, the output head, norms, biases) step with
AdamW in the same optimizer, so that schedulers, checkpoints and ZeRO see one optimizer.

Newton-Schulz is a function of the whole matrix: run on a shard (zero2/zero3/hsdp's rows, tp's columns) it gives
another, wrong, update. The momentum is elementwise, so each rank keeps it for its own shard; only the update to
orthogonalise is assembled whole. How: every rank all-gathers the matrix and orthogonalises it (`full_tensor`),
then keeps its own shard of the result. The other way, one rank per matrix orthogonalising and scattering, does 1/N
of the arithmetic but turns one collective into a gather and a scatter per matrix, and leaves ranks idle on uneven
matrices; at the sizes these runs train (Newton-Schulz is a few matrix products per matrix, small beside the
forward and backward) the gather is the simpler and the cheaper in latency; docs/strategies.md has the measured cost.

Experts stacked in a 3-D tensor (a mixture's [experts, rows, columns]) are a batch of matrices, one per expert.
Expert parallelism and zero sharding split them by expert, so each rank already holds whole matrices: they are
orthogonalised where they are, with no gather. zero1 hands each rank whole parameters, so nothing is gathered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.adam import adam

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
NS_EPS = 1e-7
#: muon_lr_scale's names for torch's step-size rules.
LR_SCALES = {"match-adamw": "match_rms_adamw", "original": "original"}


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked `use_muon` (2-D weights, and 3-D stacks of experts' matrices), AdamW for the rest.

    Each param group takes `use_muon` (default True), and the AdamW groups `betas` and `eps`; `lr`,
    `weight_decay`, `momentum`, `ns_steps` and `lr_scale` ("match-adamw" or "original") apply to the Muon groups
    (lr and weight_decay to both)."""

    KIND = "muon"  # the optimizer setting that builds it (optimizers/convert.py)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
        lr_scale: str = "match-adamw",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if lr_scale not in LR_SCALES:
            raise ValueError(f"lr_scale must be one of {', '.join(LR_SCALES)} (got {lr_scale!r})")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            ns_steps=ns_steps,
            lr_scale=lr_scale,
            betas=betas,
            eps=eps,
            use_muon=True,
        )
        super().__init__(params, defaults)
        self.gathered_bytes = 0  # what the last step all-gathered to make whole matrices of shards (bench's)
        for group in self.param_groups:
            shapes = [tuple(p.shape) for p in group["params"] if p.dim() not in (2, 3)]
            if group["use_muon"] and shapes:
                raise ValueError(f"Muon updates matrices (2-D) and stacks of them (3-D); got shapes {shapes}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.gathered_bytes = 0
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(param.grad)
            buffer = state["momentum_buffer"]
            buffer.lerp_(param.grad, 1 - group["momentum"])
            nesterov = param.grad.lerp(buffer, group["momentum"])
            update = orthogonalised(nesterov, group["ns_steps"])
            if not held_whole(nesterov):
                self.gathered_bytes += (nesterov.numel() - update.numel()) * nesterov.element_size()
            # torch's Muon: decay by the unscaled lr, step by the lr scaled for the matrix's shape.
            lr = _adjust_lr(group["lr"], LR_SCALES[group["lr_scale"]], param.shape[-2:])
            local = param.to_local() if isinstance(param, DTensor) else param
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(update.to(local.dtype), alpha=-lr)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:  # torch.optim.AdamW's states, so that its checkpoints and ours read alike
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def orthogonalised(update: torch.Tensor, ns_steps: int) -> torch.Tensor:
    """The Newton-Schulz orthogonalisation of each whole matrix of `update`, as this rank's local part (a plain
    tensor shaped like its shard)."""
    if held_whole(update):
        return _each_matrix(update.to_local() if isinstance(update, DTensor) else update, ns_steps)
    whole = _each_matrix(update.full_tensor(), ns_steps)
    # src_data_rank=None: every rank holds the same whole result, so each keeps its shard without communicating.
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None).to_local()


def held_whole(update: torch.Tensor) -> bool:
    """Whether this rank holds each of `update`'s matrices whole: a plain tensor, a replicated DTensor, or a stack
    of experts split by expert only."""
    if not isinstance(update, DTensor):
        return True
    local = update.to_local()
    if any(placement.is_partial() for placement in update.placements):
        return False  # partial sums: full_tensor adds them up
    return local.shape == update.shape or (update.dim() == 3 and local.shape[1:] == update.shape[1:])


def _each_matrix(tensor: torch.Tensor, ns_steps: int) -> torch.Tensor:
    if tensor.dim() == 2:
        return _zeropower_via_newtonschulz(tensor, NS_COEFFICIENTS, ns_steps, NS_EPS)
    if len(tensor) == 0:  # a rank given none of the experts (more ranks than experts)
        return tensor.to(torch.bfloat16)
    return torch.stack([_zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, ns_steps, NS_EPS) for matrix in tensor])
