"""Where a Hugging Face decoder language model keeps its parts, by the model's own pipeline plan
(`base_model_pp_plan`: its embedding, its list of layers and its final norm, in that order). Pipeline parallelism
cuts the model along it; sequence parallelism splits the residual stream between those parts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from multigpu.core.errors import UsageError


def decoder_plan(decoder: nn.Module) -> tuple[str, str, str]:
    """The names of a decoder's embedding, layer list and final norm, or one sentence saying it has no plan."""
    plan = list(getattr(decoder.config, "base_model_pp_plan", None) or {})
    lists = [name for name in plan if isinstance(getattr(decoder, name, None), nn.ModuleList)]
    if len(plan) < 3 or len(lists) != 1 or lists[0] in (plan[0], plan[-1]):
        raise UsageError(
            f"{type(decoder).__name__} has no pipeline plan (base_model_pp_plan: its embedding, layers and final "
            "norm, in order); run it with a strategy without pp, or write the model as an nn.Sequential of its layers."
        )
    return plan[0], lists[0], plan[-1]


def language_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The causal language model inside `model` (peft's PeftModel wraps one) and its name prefix in `model`."""
    if hasattr(model, "base_model") and hasattr(model.base_model, "model"):
        return model.base_model.model, "base_model.model."
    return model, ""


def find_decoder(model: nn.Module) -> tuple[str, nn.Module, tuple[str, str, str]] | None:
    """(the decoder's name prefix in `model`, the decoder, its plan's names) for a Hugging Face decoder language
    model with a pipeline plan; None for any other model."""
    inner, prefix = language_model(model)
    decoder = getattr(inner, "model", None)
    if not hasattr(inner, "lm_head") or not hasattr(getattr(decoder, "config", None), "base_model_pp_plan"):
        return None
    try:
        return f"{prefix}model.", decoder, decoder_plan(decoder)
    except UsageError:
        return None


def packed_attention_kwargs(config: Any, position_ids: torch.Tensor | None) -> dict[str, Any]:
    """Under flash-attention, the varlen arguments for rows of packed documents (each run of positions counting up
    from 0 a sequence of its own): transformers infers them from position_ids only for a batch of one row, and
    otherwise runs plain causal attention across the documents. {} under any other attention, or without
    position_ids (the mask built from them separates the documents there)."""
    if position_ids is None or not str(getattr(config, "_attn_implementation", "")).startswith("flash"):
        return {}
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (starts_q, starts_k), (longest_q, longest_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    return {
        "cu_seq_lens_q": starts_q,
        "cu_seq_lens_k": starts_k,
        "max_length_q": int(longest_q),
        "max_length_k": int(longest_k),
    }
