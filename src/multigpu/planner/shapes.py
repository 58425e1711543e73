"""What the planner knows of a model: parameter counts and, for transformers, the dimensions of a layer.

Read from a Hugging Face config.json (Llama-style fields), a built-in name, a bare parameter count, or an
nn.Module. Nothing is loaded or downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multigpu.core.config import json_value, read_json
from multigpu.core.errors import UsageError

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Transformer:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection in one decoder layer."""
        h, kv, i = self.hidden, self.kv_hidden, self.intermediate
        return {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def layer_params(self) -> int:
        return sum(i * o for i, o in self.linears().values()) + 2 * self.hidden  # + two RMSNorm weights

    def largest_matrix(self) -> int:
        """Elements of the largest weight: the embedding (vocab x hidden) or the widest projection."""
        return max(self.vocab * self.hidden, *(i * o for i, o in self.linears().values()))

    def total_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params() + embeddings + self.hidden


@dataclass(frozen=True)
class ModelShape:
    params: int  # every parameter
    name: str = "model"
    transformer: Transformer | None = None
    largest_unit: int = 0  # parameters of the largest FSDP unit (a layer); 0: unknown, taken as params / 10
    linear_params: int = 0  # parameters inside Linear layers other than embeddings and the head (QLoRA quantises them)
    lora_shapes: tuple[tuple[int, int], ...] = field(default=())  # (in, out) of every LoRA target, all layers
    trainable: int | None = None  # parameters that train; None: all (a module with frozen parts sets it)
    activation_bytes_per_sample: float = 0.0  # measured from a module's traced forward; 0: unknown
    largest_tensor: int = 0  # elements of the largest single parameter; 0: unknown, taken as the largest unit

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise UsageError(f"The model must have a positive number of parameters (got {self.params}).")


BUILTIN = {
    # Published configurations (config.json values), so `--model NAME` needs no file.
    "llama-2-7b": Transformer(32, 4096, 32, 32, 11008, 32000),
    "llama-3.1-8b": Transformer(32, 4096, 32, 8, 14336, 128256),
    "llama-3.1-70b": Transformer(80, 8192, 64, 8, 28672, 128256),
    "llama-3.1-405b": Transformer(126, 16384, 128, 8, 53248, 128256),
    "smollm2-135m": Transformer(30, 576, 9, 3, 1536, 49152, tied_embeddings=True),
    "qwen2.5-0.5b": Transformer(24, 896, 14, 2, 4864, 151936, tied_embeddings=True),
}


def from_transformer(t: Transformer, name: str) -> ModelShape:
    lora = tuple(shape for _ in range(t.layers) for shape in t.linears().values())
    return ModelShape(
        params=t.total_params(),
        name=name,
        transformer=t,
        largest_unit=max(t.layer_params(), t.vocab * t.hidden),
        linear_params=t.layers * sum(i * o for i, o in t.linears().values()),
        lora_shapes=lora,
        largest_tensor=t.largest_matrix(),
    )


def from_config(config: dict[str, Any], name: str) -> ModelShape:
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    json_value(config, None, dict, file=name)
    missing = [key for key in needed if key not in config]
    if missing:
        raise UsageError(
            f"{name} lacks {', '.join(missing)}; the planner reads Llama-style configs (or pass --params with "
            "--layers --hidden --heads --vocab)."
        )
    for key in needed:
        json_value(config, key, int, file=name, minimum=1)
    kv_heads = json_value(config, "num_key_value_heads", (int, type(None)), file=name, optional=True, minimum=1)
    tied = json_value(config, "tie_word_embeddings", (bool, type(None)), file=name, optional=True)
    t = Transformer(
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        heads=config["num_attention_heads"],
        kv_heads=kv_heads or config["num_attention_heads"],
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied_embeddings=bool(tied),
    )
    return from_transformer(t, name)


def from_counts(
    params: float, layers: int | None, hidden: int | None, heads: int | None, vocab: int | None
) -> ModelShape:
    """`--params` alone (model states only), or with the dimensions that give activations too."""
    if not 0 < params < math.inf:
        raise UsageError(f"--params must be positive and finite (got {params:g}).")
    dims = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab}
    given = {key: value for key, value in dims.items() if value is not None}
    if not given:
        return ModelShape(params=int(params), name=f"{params:.3g} parameters")
    if len(given) < len(dims) or any(value <= 0 for value in given.values()):
        raise UsageError("--layers, --hidden, --heads and --vocab go together, each a positive integer.")
    # Llama's MLP width (8/3 h, rounded to 256) when only the parameter count is known.
    t = Transformer(layers, hidden, heads, heads, -(-8 * hidden // 3 // 256) * 256, vocab)
    return ModelShape(
        params=int(params),
        name=f"{params:.3g} parameters",
        transformer=t,
        largest_unit=t.layer_params(),
        linear_params=int(params) - 2 * vocab * hidden,
        lora_shapes=tuple(shape for _ in range(layers) for shape in t.linears().values()),
        largest_tensor=t.largest_matrix(),
    )


def load_shape(model: str) -> ModelShape:
    """`model` is a built-in name, a config.json, or a directory holding one."""
    if model in BUILTIN:
        return from_transformer(BUILTIN[model], model)
    advice = f"pass a built-in ({', '.join(BUILTIN)}), a config.json or a directory with one"
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    config = read_json(path, advice, "--model", "a config.json")
    return from_config(config, str(path))


def saved_activation_bytes(module: Any, sample: Any) -> float:
    """Bytes autograd keeps for backward in one forward of `module` on `sample` (parameters excluded)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in params:
            seen[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(sample)
    return float(sum(seen.values()))


def from_module(module: Any, sample_input: Any = None) -> ModelShape:
    """Counts an nn.Module's parameters; its FSDP units give the largest gathered unit. With `sample_input` (one
    sample, batch dimension 1) a traced forward measures the activations per sample."""
    from torch import nn

    from multigpu.core.modules import default_units

    units = default_units(module) or [module]
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return ModelShape(
        params=sum(p.numel() for p in module.parameters()),
        name=type(module).__name__,
        largest_unit=max(sum(p.numel() for p in unit.parameters()) for unit in units),
        linear_params=sum(m.weight.numel() for m in linears),
        lora_shapes=tuple((m.in_features, m.out_features) for m in linears),
        trainable=sum(p.numel() for p in module.parameters() if p.requires_grad),
        activation_bytes_per_sample=0.0 if sample_input is None else saved_activation_bytes(module, sample_input),
        largest_tensor=max((p.numel() for p in module.parameters()), default=0),
    )
