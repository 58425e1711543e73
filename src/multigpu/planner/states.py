"""Bytes of a model's states (parameters, gradients, optimizer states) and how data-parallel ranks divide them. A
mixture's routed experts are counted apart: expert parallelism gives each rank of an ep group 1/ep of them before
the data-parallel strategy shards what a rank holds. Pure arithmetic."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from multigpu.planner.shapes import ModelShape

if TYPE_CHECKING:
    from multigpu.planner.plan_config import PlanConfig


def bytes_per_param(precision: str) -> int:
    """Stored weights and their gradients: fp32 master weights in every mode but bf16-true."""
    return 2 if precision == "bf16-true" else 4


#: Bytes of state per parameter in each low-bit optimizer, two states each: bf16's 2 bytes, torchao's 8-bit codes
#: with a float32 scale per 256 values, its 4-bit codes with one per 128 (tensors under 4,096 values stay float32,
#: too few to count).
LOW_BIT_STATE_BYTES = {"adamw-bf16": 2 * 2, "adamw-8bit": 2 * (1 + 4 / 256), "adamw-4bit": 2 * (0.5 + 4 / 128)}


def optimizer_bytes(optimizer: str, precision: str, trainable: int, matrices: int) -> float:
    """Optimizer-state bytes of `trainable` parameters, `matrices` of them Muon's under muon (one momentum each; the
    rest AdamW's two states); sgd keeps one momentum buffer."""
    state = bytes_per_param(precision)
    if optimizer in LOW_BIT_STATE_BYTES:
        return trainable * LOW_BIT_STATE_BYTES[optimizer]
    if optimizer == "muon":
        return matrices * state + (trainable - matrices) * 2 * state
    return trainable * (state if optimizer == "sgd" else 2 * state)


def muon_matrices(shape: ModelShape, trainable: int, lora: bool) -> int:
    """The trainable parameters Muon takes: every adapter (LoRA's are matrices), the experts, and the hidden linear
    layers' weights (not the embeddings nor the head)."""
    if lora or shape.name == "experts":
        return trainable
    return min(trainable, shape.linear_params)


def model_states(shape: ModelShape, config: PlanConfig) -> tuple[float, float, float, int]:
    """Unsharded bytes of parameters, gradients and optimizer states, and the trainable parameter count."""
    weight = bytes_per_param(config.precision)
    if config.lora_r is None:
        trainable = shape.params if shape.trainable is None else shape.trainable
        params = shape.params * weight
    else:
        trainable = sum(config.lora_r * (i + o) for i, o in shape.lora_shapes)
        base = shape.params * weight
        if config.qlora:
            # nf4: half a byte per weight of the quantised linears, plus an fp32 scale per block of 64 weights.
            frozen_16bit = (shape.params - shape.linear_params) * 2
            base = shape.linear_params * (0.5 + 4 / 64) + frozen_16bit
        params = base + trainable * weight
    matrices = muon_matrices(shape, trainable, config.lora_r is not None)
    optimizer = optimizer_bytes(config.optimizer, config.precision, trainable, matrices)
    return params, trainable * weight, optimizer, trainable


def split_experts(shape: ModelShape) -> tuple[ModelShape, ModelShape | None]:
    """(everything but the routed experts, the routed experts; None for a dense model). The experts hold no LoRA
    target and no quantised linear (shapes.py says why); they train in a full fine-tune, or, in a module with frozen
    parts, as far as its trainable count reaches."""
    if not shape.expert_params:
        return shape, None
    experts_trainable = shape.expert_params if shape.trainable is None else min(shape.expert_params, shape.trainable)
    rest = replace(
        shape,
        params=shape.params - shape.expert_params,
        trainable=None if shape.trainable is None else shape.trainable - experts_trainable,
        expert_params=0,
    )
    return rest, ModelShape(params=shape.expert_params, name="experts", trainable=experts_trainable)


def sharded_states(shape: ModelShape, config: PlanConfig, ranks: int, ep: int = 1) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank where a strategy shards them over `ranks`. The experts are first
    split over the ep group, and each slice is sharded over the ranks that hold the same experts: ranks / ep when
    the ep group lies inside the sharding group (ep drawn from shard x cp, as config/layout.py draws it), so the
    experts too come to 1/ranks of their bytes per rank; ep changes what is gathered whole, not the shards."""
    rest, experts = split_experts(shape)
    params, grads, optimizer, _ = (part / ranks for part in model_states(rest, config))
    if experts is None:
        return params, grads, optimizer
    slices = ep * (ranks // math.gcd(ranks, ep))  # ep slices, each sharded over the ranks outside the ep group
    expert_params, expert_grads, expert_optimizer, _ = model_states(experts, config)
    return params + expert_params / slices, grads + expert_grads / slices, optimizer + expert_optimizer / slices
