"""Float8 training through torchao: a model's linear layers swapped for torchao's Float8Linear, which casts each
matrix product's operands to float8 (e4m3, 3 mantissa bits) with a scale per tensor (tensorwise) or per row
(rowwise), multiplies them in float8 and keeps the weights, the optimizer and everything else as they were.

The swap comes first, before tensor parallelism, recomputation, compilation and sharding (torchao's and torchtitan's
order), so those see Float8Linear layers under the names the plain layers had. It leaves out the layers float8
cannot take or should not: dimensions that are not multiples of 16 (float8's matrix kernels need them), the
output head (the logits are the one product whose rounding the loss sees directly, and torchtitan leaves it out
too), a weight tied to another layer's (a swap could untie it) and any subclass of nn.Linear (bitsandbytes' packed
4-bit layers, a LoRA wrapper's own kinds). On the CPU the float8 products are emulated (the same casts and scales,
the product then taken in the operands' original width): every composition runs here, the speed only on a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from multigpu.core.errors import UsageError
from multigpu.transforms.modules import repoint

RECIPES = ("tensorwise", "rowwise")
#: The first NVIDIA GPUs whose tensor cores multiply float8 (Ada Lovelace, then Hopper, Blackwell).
MIN_CAPABILITY = (8, 9)
#: Left-out layers named one by one in the summary; more than this are counted.
_NAMED = 4


def check_float8(recipe: str, device: torch.device) -> None:
    """Refuses float8 on a GPU whose tensor cores have no float8 (compute capability below 8.9)."""
    if recipe == "none" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UsageError(
            f"float8 {recipe} needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell), and this "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}; drop --float8 or train on such "
            "a GPU."
        )


def float8_config(recipe: str, device: torch.device, all_gather: bool = False) -> Any:
    """torchao's Float8LinearConfig for `recipe`: emulated off the GPU; with `all_gather` (tensorwise under FSDP),
    the sharded weights cast to float8 before their all-gather, which then moves a quarter of fp32's bytes."""
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        config, emulate=device.type != "cuda", enable_fsdp_float8_all_gather=all_gather and recipe == "tensorwise"
    )


def output_head(model: nn.Module) -> nn.Module | None:
    """The layer that makes the model's outputs: a Hugging Face model's output embeddings (lm_head), else its last
    nn.Linear in module order (torchtitan's `output`, an MLP's last layer)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if isinstance(head, nn.Linear):
        return head
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    return linears[-1] if linears else None


def left_out(model: nn.Module) -> dict[str, str]:
    """Name -> why, for each nn.Linear of `model` that stays as it is under float8."""
    head = output_head(model)
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    reasons = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if type(module) is not nn.Linear:
            reasons[name] = f"a {type(module).__name__}, not a plain nn.Linear"
        elif module is head:
            reasons[name] = "the output head"
        elif module.in_features % 16 or module.out_features % 16:
            reasons[name] = f"{module.in_features} x {module.out_features}, not multiples of 16"
        elif owners[id(module.weight)] > 1:
            reasons[name] = "its weight is tied to another layer's"
    return reasons


def convert_linears(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    recipe: str,
    device: torch.device,
    all_gather: bool = False,
) -> str | None:
    """Swaps `model`'s linear layers for float8 ones in place (see the module's doc for which), `optimizer` pointed
    at the weights that float8 all-gather wraps anew; returns what it did, in a line, or None for recipe "none". A
    model with no layer float8 can take is refused."""
    if recipe == "none":
        return None
    if recipe not in RECIPES:
        raise ValueError(f"unknown float8 recipe {recipe!r}")
    reasons = left_out(model)
    total = sum(isinstance(module, nn.Linear) for module in model.modules())
    if total == len(reasons):
        why = "; ".join(f"{name or type(model).__name__}: {reason}" for name, reason in list(reasons.items())[:_NAMED])
        raise UsageError(
            f"float8 {recipe} finds none of {type(model).__name__}'s {total} linear layer(s) it can take ({why}); "
            "float8 needs plain nn.Linear layers besides the output head with both dimensions multiples of 16: "
            "drop --float8 or widen the layers."
        )
    config = float8_config(recipe, device, all_gather)
    names = {id(param): name for name, param in model.named_parameters()}
    _torchao_float8().convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, name: name not in reasons
    )
    repoint(optimizer, names, model)
    if not config.emulate:
        for layer in float8_layers(model):
            layer.register_forward_pre_hook(check_rows)
    return summary(recipe, total, reasons, config)


def check_rows(layer: nn.Module, args: tuple) -> None:
    """Refuses, in training on a GPU, a micro-batch whose rows (tokens) are not a multiple of 16: a layer's weight
    gradient is a product over them, and torch's float8 matrix product takes only multiples of 16 there."""
    rows = args[0].numel() // max(args[0].shape[-1], 1)
    if torch.is_grad_enabled() and rows % 16:
        raise UsageError(
            f"float8 training on a GPU multiplies each weight's gradient over a micro-batch's rows (tokens), which "
            f"torch's float8 product takes in multiples of 16, and this process's micro-batch has {rows}; pad each "
            "batch to a multiple of 16 tokens (the padding masked out of the loss) or drop --float8."
        )


def summary(recipe: str, total: int, reasons: dict[str, str], config: Any) -> str:
    """One line: how many linear layers run in float8, how, and which are left out and why."""
    emulated = " (emulated off the GPU)" if config.emulate else ""
    gathered = ", their weights all-gathered in float8" if config.enable_fsdp_float8_all_gather else ""
    named = [f"{name} ({reason})" for name, reason in list(reasons.items())[:_NAMED]]
    if len(reasons) > _NAMED:
        named.append(f"{len(reasons) - _NAMED} more")
    kept = f"; left out: {', '.join(named)}" if named else ""
    return f"float8 {recipe}{emulated}: {total - len(reasons)} of {total} linear layers{gathered}{kept}"


def float8_layers(model: nn.Module) -> list[nn.Module]:
    """The Float8Linear layers of `model` (none where torchao was never imported: nothing was converted)."""
    import sys

    module = sys.modules.get("torchao.float8.float8_linear")
    if module is None:
        return []
    return [layer for layer in model.modules() if isinstance(layer, module.Float8Linear)]


def refresh_all_gather_scales(model: nn.Module) -> None:
    """After an optimizer step that changed the weights: the float8 scales of the sharded weights that FSDP
    all-gathers in float8, from their new values, in one all-reduce for all of them (without it, each weight's
    all-gather would work out its own scale, one all-reduce each). Nothing for a model without such weights."""
    if float8_layers(model):
        _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def _torchao_float8() -> Any:
    """torchao.float8, imported on first use (only a run with float8 on needs it)."""
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise UsageError(f"float8 training needs torchao ({error}); install it (pip install torchao).") from None
    return float8


class _DropImportNoise(logging.Filter):
    """At import torchao tries to load its compiled kernels (mxfp8, CUTLASS for sm90a) and logs each one this
    machine's torch cannot load, and torch logs a deprecation that torchao's own code triggers. Float8 training runs
    torch's float8 matrix product, not those kernels, and neither line is the user's to act on. transformers imports
    torchao whenever it is installed, float8 or not, so the lines are dropped from here on (multigpu's Engine imports
    this module before any model is built)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load") or "is an Enum subclass" in message)


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_DropImportNoise())
