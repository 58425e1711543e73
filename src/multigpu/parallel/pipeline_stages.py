"""The stages a pipeline cuts a model into: for each stage, the modules it holds (by their names in the whole model)
and the module that runs them. An `nn.Sequential` is cut between its children, a model with `pp_layers` between
the layers it names, a Hugging Face decoder language model (embeddings, decoder layers, final norm and head) by
the parts its `base_model_pp_plan` names: the embeddings with the first stage, the norm and head with the last."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from multigpu.config.pipeline import stage_layers
from multigpu.core.errors import UsageError
from multigpu.parallel.decoder import decoder_plan, language_model, packed_attention_kwargs
from multigpu.transforms.modules import name_pattern


class SequentialStage(nn.Module):
    # A stage holds its modules as children, so that zero2/zero3 can shard it as one tree (the stage its root); the
    # same modules are the PipelineModel's, under the whole model's names.
    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


class DecoderStage(nn.Module):
    """A run of a Hugging Face decoder's layers; the first stage embeds the tokens, the last applies the final
    norm and the head. Every stage gets the batch's keywords (the attention mask, or the position_ids of packed
    documents) from the schedule, micro-batched along the rows; the hidden states come from the previous stage."""

    def __init__(
        self,
        decoder: nn.Module,
        names: tuple[str, str, str],
        head: nn.Module,
        layers: list[nn.Module],
        held: list[nn.Module],
        first: bool,
        last: bool,
    ) -> None:
        super().__init__()
        self.held = nn.ModuleList(held)  # the stage's own modules as children, as SequentialStage's
        # The decoder and head are reached through a dict: their other stages' modules (on meta) are not this one's.
        self.parts = {"decoder": decoder, "head": head, "layers": layers}
        self.embed, _, self.norm = names  # the decoder's attributes, by its pipeline plan
        self.first, self.last = first, last
        #: Sequence parallelism hands the later stages each sequence split into this many parts by position.
        self.position_split = 1

    def forward(
        self,
        hidden: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,  # a stage keeps no cache; taken so that one batch of inputs serves both
    ) -> Any:
        from transformers.masking_utils import create_causal_mask

        decoder = self.parts["decoder"]
        hidden = input_ids if hidden is None else hidden  # the first stage: the tokens, as a keyword
        length = hidden.shape[1] * (1 if self.first else self.position_split)  # the whole sequence's
        if position_ids is None:
            positions = torch.arange(length, device=hidden.device).unsqueeze(0)
            if attention_mask is None:
                attention_mask = torch.ones((hidden.shape[0], length), dtype=torch.long, device=hidden.device)
        else:
            # Packed documents: with no attention_mask, the mask is causal within each run of positions that
            # counts up from 0, and flash-attention takes those runs as its varlen sequences.
            positions = position_ids
        if self.first:
            hidden = getattr(decoder, self.embed)(hidden)
        rotary = decoder.rotary_emb(hidden, positions)
        mask = create_causal_mask(
            config=decoder.config,
            inputs_embeds=hidden.new_empty((hidden.shape[0], length, 0)),  # the mask reads its shape and dtype
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=positions,
        )
        varlen = packed_attention_kwargs(decoder.config, position_ids if attention_mask is None else None)
        for layer in self.parts["layers"]:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary, **varlen)
        if self.last:
            return self.parts["head"](getattr(decoder, self.norm)(hidden))
        return hidden


def stage_parts(
    model: nn.Module, stages: int, split: str | tuple[float, ...] | None = None, schedule: str | None = None
) -> list[tuple[dict[str, nn.Module], Callable[[bool, bool], nn.Module]]]:
    """For each stage: {name in the model: module} and a function (first, last) -> the stage's forward module; the
    layers split by `split` (pp_split's counts, or the stages' speeds), else as evenly as they allow."""
    inner, prefix = language_model(model)
    if _is_decoder(inner):
        return _decoder_parts(inner, prefix, stages, decoder_plan(inner.model), split, schedule)
    children = _pipeline_layers(model)
    parts = []
    for run in stage_layers(len(children), stages, split, schedule):
        chunk = children[run.start : run.stop]
        modules = [module for _, module in chunk]
        parts.append((dict(chunk), lambda first, last, modules=modules: SequentialStage(modules)))
    return parts


def layer_count(model: nn.Module) -> int:
    """How many layers strategy pp shares out among the stages of `model`."""
    inner, _ = language_model(model)
    if _is_decoder(inner):
        return len(getattr(inner.model, decoder_plan(inner.model)[1]))
    return len(_pipeline_layers(model))


def _is_decoder(inner: nn.Module) -> bool:
    return hasattr(inner, "lm_head") and hasattr(getattr(inner, "model", None), "rotary_emb")


def _pipeline_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    given = getattr(model, "pp_layers", None)
    if given or isinstance(model, nn.Sequential):
        return listed_layers(model, given) if given else list(model.named_children())
    raise UsageError(
        f"Strategy pp splits an nn.Sequential, a model with a pp_layers list or a Hugging Face decoder language "
        f"model, not {type(model).__name__}; give it pp_layers (its layers' names in the order each takes the "
        "previous one's output), or use another strategy."
    )


def listed_layers(model: nn.Module, names: list[str]) -> list[tuple[str, nn.Module]]:
    """The modules a model's `pp_layers` names, in its order; a pattern's `*` stands for one name in the path
    ("blocks.*"), its matches in the model's order. The pipeline cuts between them."""
    modules = dict(model.named_modules())
    found: list[tuple[str, nn.Module]] = []
    for pattern in names:
        regex = name_pattern(pattern)
        matched = [(name, module) for name, module in modules.items() if name and regex.fullmatch(name)]
        if not matched:
            raise UsageError(
                f"pp_layers names {pattern!r}, which matches no module of {type(model).__name__}; correct it (names "
                "as model.named_modules() gives them)."
            )
        found += matched
    return found


def _decoder_parts(
    inner: nn.Module,
    prefix: str,
    stages: int,
    names: tuple[str, str, str],
    split: str | tuple[float, ...] | None,
    schedule: str | None,
) -> list:
    embed, layer_list, norm = names
    decoder, layers = inner.model, list(getattr(inner.model, layer_list))
    parts = []
    for index, run in enumerate(stage_layers(len(layers), stages, split, schedule)):
        first, last = index == 0, index == stages - 1
        kept = {f"{prefix}model.{layer_list}.{i}": layers[i] for i in run}
        kept[f"{prefix}model.rotary_emb"] = decoder.rotary_emb
        if first:
            kept[f"{prefix}model.{embed}"] = getattr(decoder, embed)
        if last:
            kept[f"{prefix}model.{norm}"] = getattr(decoder, norm)
            kept[f"{prefix}lm_head"] = inner.lm_head
        chunk, held = [layers[i] for i in run], list(kept.values())
        parts.append((kept, lambda f, la, c=chunk, h=held: DecoderStage(decoder, names, inner.lm_head, c, h, f, la)))
    return parts
