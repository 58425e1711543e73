"""How a model's attention becomes context parallelism's (parallel/context.py): a Hugging Face decoder through a
transformers attention function registered for it, a model of one's own through the modules its `cp_attention`
names, inside which torch's scaled_dot_product_attention is replaced while they run."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from multigpu.core.errors import UsageError
from multigpu.parallel.context import TORCH_SDPA, ContextParallel, check_heads
from multigpu.transforms.modules import name_pattern

#: The name context parallelism's attention is registered under in transformers' attention functions.
ATTENTION = "multigpu_context_parallel"


def hf_attention(cp: ContextParallel) -> Callable[..., tuple[torch.Tensor, None]]:
    """A transformers attention function (AttentionInterface) for `cp`'s method: Ulysses', or causal sdpa, which
    torch's context_parallel turns into ring attention. It is registered with no mask function, so transformers
    builds no mask from the slices' position_ids."""

    def attend(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if kwargs.get("sliding_window") or kwargs.get("softcap"):
            raise UsageError(
                f"{type(module).__name__} uses a sliding window or a soft cap, which context parallelism's attention "
                "does not compute; drop cp_size for this model."
            )
        if cp.method == "ulysses":
            return cp.attention(query, key, value, kwargs.get("position_ids"), scaling, dropout), None
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling)
        return out.transpose(1, 2), None

    return attend


def use_context_attention(model: nn.Module, cp: ContextParallel) -> None:
    """Makes every Hugging Face decoder inside `model` attend through `cp`'s method, or, in a model of one's own,
    the modules its `cp_attention` names (module-name patterns, `*` for one name)."""
    configs = {
        id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")
    }
    if not configs:
        attend_in_named_modules(model, cp)
        return
    from transformers import AttentionInterface  # imported by runs with cp only

    AttentionInterface.register(ATTENTION, hf_attention(cp))
    for config in configs.values():
        if cp.method == "ulysses":
            check_heads(config.num_attention_heads, cp.size)
        config._attn_implementation = ATTENTION


def attend_in_named_modules(model: nn.Module, cp: ContextParallel) -> None:
    """Inside each module that `model`'s `cp_attention` names, torch's scaled_dot_product_attention (called as
    F.scaled_dot_product_attention) becomes Ulysses' (under ring, torch's context_parallel replaces it everywhere
    itself). The model's forward must take position_ids, the place of each token of its slice."""
    owner = next((m for m in model.modules() if getattr(m, "cp_attention", None)), None)
    if owner is None:
        raise UsageError(
            f"Context parallelism must know where {type(model).__name__} computes attention; give the model a "
            "cp_attention attribute listing its attention modules' name patterns (e.g. ['blocks.*.attn']), or "
            "drop cp_size."
        )
    if "position_ids" not in inspect.signature(owner.forward).parameters:
        raise UsageError(
            f"Context parallelism gives each rank a slice of every sequence, so {type(owner).__name__}.forward must "
            "take position_ids (each token's place in its sequence) and place its tokens by them; add that argument."
        )
    modules = dict(owner.named_modules())
    for pattern in owner.cp_attention if cp.method == "ulysses" else ():
        matched = [modules[n] for n in modules if name_pattern(pattern).fullmatch(n)]
        if not matched:
            raise UsageError(
                f"cp_attention's pattern {pattern!r} matches no module of {type(owner).__name__}; correct it (names "
                "as named_modules() gives them) or remove it."
            )
        for module in matched:
            module.forward = _with_attention(module.forward, cp)


def _with_attention(forward: Callable[..., Any], cp: ContextParallel) -> Callable[..., Any]:
    """`forward` with torch's scaled_dot_product_attention replaced by `cp`'s while it runs."""

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or not is_causal:
            raise UsageError(
                "Context parallelism computes causal attention over each whole sequence (packed documents apart, by "
                "position_ids); call scaled_dot_product_attention with is_causal=True and no attn_mask in the "
                "modules cp_attention names."
            )
        return cp.attention(query, key, value, cp.positions, scale, dropout_p).transpose(1, 2)

    @functools.wraps(forward)
    def attending(*args: Any, **kwargs: Any) -> Any:
        F.scaled_dot_product_attention = sdpa
        try:
            return forward(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = TORCH_SDPA

    return attending
