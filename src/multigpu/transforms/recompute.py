"""Activation checkpointing of a model's blocks: what each block keeps from its forward for the backward.

A block's forward is replaced on the instance, not wrapped in another module, so its parameters' names (what tp
plans, pipeline cuts, checkpoints and adapters are keyed by) stay as they are, and a strategy that shards the block
(FSDP's fully_shard) still sees the block itself: its hooks run around the forward, and a recomputation in backward
runs inside them, with the parameters gathered, as torchtitan's checkpoint wrapper inside a sharded block does.

- full: keeps each block's inputs only and runs its forward again in backward.
- selective: also keeps the outputs of the matrix products and attention (torch's selective checkpoint policy), so
  that only the cheap element-wise ops run again.
- offload: recomputes nothing; every tensor the block saves for backward waits in host memory (pinned, on a GPU).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from multigpu.config.settings import RECOMPUTE_MODES as MODES
from multigpu.transforms.modules import stop_caching

# The share of a block's forward that backward runs again: full, all of it; selective, only the element-wise ops
# between the kept products (well under 1% of a transformer's FLOPs, counted as none); offload, nothing. The
# planner's simulator adds it to the compute (a forward is a third of a step's FLOPs) and, under tp, to the forward
# all-reduces.
FORWARD_RUN_AGAIN = {"none": 0.0, "full": 1.0, "selective": 0.0, "offload": 0.0}

# The ops whose outputs selective keeps: the compute-bound ones, where running again costs the most per byte kept.
_KEPT_OPS = (
    "mm",
    "addmm",
    "bmm",
    "linear",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
# Collectives inside a block (tp's all-reduces, sequence parallelism's reduce-scatters): kept, so that a
# recomputation never communicates again.
_KEPT_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor")


def recompute_blocks(model: nn.Module, blocks: Iterable[nn.Module], mode: str) -> None:
    """Makes each of `blocks` of `model` keep for backward what `mode` says (see the module's doc); "none" leaves
    them. A Hugging Face model stops filling its key/value cache (transforms/modules.py: stop_caching)."""
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    if mode == "none":
        return
    stop_caching(model)
    for block in blocks:
        block._recompute_mode = mode  # read by the forward below; a deep copy of the block keeps it
        block.forward = types.MethodType(_forward, block)


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = functools.partial(type(self).forward, self)  # the class's forward: FSDP's class swap keeps it
    if self._recompute_mode == "offload":
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return forward(*args, **kwargs)
    if not torch.is_grad_enabled():  # evaluation saves nothing, so there is nothing to recompute
        return forward(*args, **kwargs)
    if self._recompute_mode == "selective":
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_keep_matmuls, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _keep_matmuls() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_policy)


@functools.cache
def _kept_ops() -> frozenset[Any]:
    kept = [getattr(torch.ops.aten, name).default for name in _KEPT_OPS if hasattr(torch.ops.aten, name)]
    functional = torch.ops._c10d_functional
    return frozenset(kept + [getattr(functional, name).default for name in _KEPT_COLLECTIVES])


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE
