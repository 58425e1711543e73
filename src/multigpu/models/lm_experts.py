"""Mixtures of experts in the language-model recipes: the checks before any worker starts, which parameters
--lora-experts adapts, and what `multigpu finetune` says of the routers as it trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from multigpu.core.errors import UsageError
from multigpu.parallel.experts import find_layers


def check_experts(directory: Path, name: str, ep: int) -> None:
    """Refuses, before any process starts, an ep degree for model `name` (its files in `directory`) without
    experts, or one that does not divide their number (the Engine refuses both too, in every worker, for a model
    of one's own)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        raise UsageError(
            f"--ep-size {ep} spreads a mixture-of-experts model's experts, and --model {name} has none; drop "
            "--ep-size or choose a mixture (tiny-moe, or a Qwen3-MoE, Mixtral or OLMoE directory)."
        )
    if experts % ep:
        raise UsageError(
            f"--ep-size {ep} does not divide --model {name}'s {experts} experts per layer; choose an --ep-size that "
            f"divides {experts}."
        )


def expert_targets(model: torch.nn.Module) -> list[str]:
    """The parameters of every mixture layer's experts and router, as peft's target_parameters names them (the
    end of their names); refuses a model without experts."""
    layers = find_layers(model, default_top_k=0)
    if not layers:
        raise UsageError(
            "--lora-experts adapts a mixture-of-experts model's experts, and this model has none; drop it."
        )
    prefix = layers[0].name.split(".")
    names = [f"{layer.name}.{name}" for layer in layers for name, _ in layer.experts.named_parameters()]
    names += [n for n, p in model.named_parameters() if any(p is layer.router.weight for layer in layers)]
    # The names past the layer index: "mlp.experts.gate_up_proj", the same in every layer.
    depth = next(i for i, part in enumerate(prefix) if part.isdigit()) + 1
    return sorted({".".join(name.split(".")[depth:]) for name in names})


def expert_progress(engine: Any, step: int, log_every: int) -> tuple[str, dict[str, Any] | None]:
    """A step's words for the progress line (the load-balancing loss), and the routers' metrics (logged every
    `log_every` steps); nothing for a dense model. Every rank calls it (a collective under pp)."""
    if engine.experts is None:  # the step's last micro-batch's, over every data-parallel rank
        return "", None
    load = engine.experts.metrics()
    if log_every and step % log_every == 0:
        engine.log(step, load)
    return f"aux {load['moe_aux_loss']:.4f} ", load


def expert_summary(load: dict[str, Any]) -> str:
    return (
        f"router load-balancing loss at the last step {load['moe_aux_loss']:.6f}; its tokens per ep rank "
        f"{load['moe_tokens_per_rank']}, the busiest expert {load['moe_busiest_expert_vs_mean']:.2f} x the mean"
    )
