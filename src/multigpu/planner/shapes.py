"""What the planner knows of a model: parameter counts and, for transformers, the dimensions of a layer.

Read from a Hugging Face config.json (Llama-style fields; the mixtures of experts of Qwen2/3-MoE, Mixtral, OLMoE and
gpt-oss too), a built-in name, a bare parameter count, or an nn.Module. Nothing is loaded or downloaded.

A mixture-of-experts layer keeps attention and replaces the MLP by `experts` MLPs of width `expert_intermediate`
(gate, up and down: 3 x hidden x width each), a router (experts x hidden) that sends each token to
`experts_per_token` of them, and in Qwen2-MoE a shared expert beside them. Hugging Face (transformers 5) stores a
layer's experts as two 3-D parameters (gate_up_proj, down_proj), not as nn.Linear: bitsandbytes leaves them
unquantised under QLoRA, and peft's default targets skip them, so the planner's LoRA adapters sit on the linear
projections only (attention, dense MLPs, shared experts).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from multigpu.config.flags import json_value, read_json
from multigpu.core.errors import UsageError

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Transformer:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int  # the dense MLP's width: every layer of a dense model, the dense layers of a mixture
    vocab: int
    tied_embeddings: bool = False
    explicit_head_dim: int = 0  # config.json's head_dim where heads x head_dim is not hidden (Qwen3); 0: hidden/heads
    qk_norm: int = 0  # weights of a layer's query and key norms (Qwen3: 2 x head_dim; OLMoE: hidden + kv width)
    experts: int = 0  # routed experts in each mixture-of-experts layer; 0: a dense model
    experts_per_token: int = 0  # top-k: the experts each token is routed to
    expert_intermediate: int = 0  # one expert's MLP width (Qwen: moe_intermediate_size)
    moe_layers: int = 0  # how many of the layers are mixtures (the rest have the dense MLP)
    shared_expert_intermediate: int = 0  # Qwen2-MoE: an MLP every token runs beside its experts, gated by 1 x hidden

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    @property
    def q_hidden(self) -> int:
        """The width of the queries and of attention's output: heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_hidden(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def attention_linears(self) -> dict[str, tuple[int, int]]:
        h, q, kv = self.hidden, self.q_hidden, self.kv_hidden
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}

    def mlp_linears(self, width: int) -> dict[str, tuple[int, int]]:
        """A SwiGLU MLP's projections (a dense layer's, or a shared expert's); none at width 0."""
        if not width:
            return {}
        h = self.hidden
        return {"gate_proj": (h, width), "up_proj": (h, width), "down_proj": (width, h)}

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection in one dense decoder layer."""
        return {**self.attention_linears(), **self.mlp_linears(self.intermediate)}

    def moe_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each nn.Linear in one mixture-of-experts layer: attention's and a shared expert's."""
        return {**self.attention_linears(), **self.mlp_linears(self.shared_expert_intermediate)}

    def layer_params(self) -> int:
        """One dense layer: its projections, two RMSNorm weights and any query/key norms."""
        return sum(i * o for i, o in self.linears().values()) + 2 * self.hidden + self.qk_norm

    def layer_experts(self) -> int:
        """The routed experts' parameters in one mixture-of-experts layer (gate, up and down of each)."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    def moe_layer_params(self) -> int:
        """One mixture-of-experts layer: its linears, experts, router (and a shared expert's gate) and norms."""
        router = self.experts * self.hidden + (self.hidden if self.shared_expert_intermediate else 0)
        linears = sum(i * o for i, o in self.moe_linears().values())
        return linears + self.layer_experts() + router + 2 * self.hidden + self.qk_norm

    def layer_kinds(self, layers: int) -> tuple[int, int]:
        """(dense, mixture) layers among `layers` of the model's (a pipeline stage's: the mixtures in proportion,
        rounded up, since the stage that binds is the one holding more of them)."""
        moe = min(layers, -(-layers * self.moe_layers // self.layers))
        return layers - moe, moe

    def largest_matrix(self) -> int:
        """Elements of the largest weight: the embedding (vocab x hidden), the widest projection, or a mixture
        layer's experts' gate_up_proj (experts x 2 x width x hidden, one tensor in Hugging Face's layout)."""
        fused = self.experts * 2 * self.expert_intermediate * self.hidden if self.moe_layers else 0
        return max(self.vocab * self.hidden, fused, *(i * o for i, o in self.linears().values()))

    def total_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        layers = self.dense_layers * self.layer_params() + self.moe_layers * self.moe_layer_params()
        return layers + embeddings + self.hidden

    def expert_params(self) -> int:
        """Every routed expert's parameters, all layers: what expert parallelism divides."""
        return self.moe_layers * self.layer_experts()

    def active_params(self) -> int:
        """The parameters one token computes with: every weight but the experts it is not routed to."""
        idle = self.experts - self.experts_per_token
        return self.total_params() - self.moe_layers * idle * 3 * self.hidden * self.expert_intermediate


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
    expert_params: int = 0  # of `params`, the routed experts' (expert parallelism divides them)
    experts: int = 0  # routed experts per mixture-of-experts layer (ep must divide them); 0: a dense model
    active_params: int = 0  # the parameters one token computes with (a mixture's); 0: all of them

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise UsageError(f"The model must have a positive number of parameters (got {self.params}).")

    @property
    def active(self) -> int:
        return self.active_params or self.params


BUILTIN = {
    # Published configurations (config.json values), so `--model NAME` needs no file.
    "llama-2-7b": Transformer(32, 4096, 32, 32, 11008, 32000),
    "llama-3.1-8b": Transformer(32, 4096, 32, 8, 14336, 128256),
    "llama-3.1-70b": Transformer(80, 8192, 64, 8, 28672, 128256),
    "llama-3.1-405b": Transformer(126, 16384, 128, 8, 53248, 128256),
    "smollm2-135m": Transformer(30, 576, 9, 3, 1536, 49152, tied_embeddings=True),
    "qwen2.5-0.5b": Transformer(24, 896, 14, 2, 4864, 151936, tied_embeddings=True),
    # Qwen/Qwen3-30B-A3B: 48 mixture layers of 128 experts (8 per token); intermediate_size 6144 is unused.
    "qwen3-30b-a3b": Transformer(
        48,
        2048,
        32,
        4,
        6144,
        151936,
        explicit_head_dim=128,
        qk_norm=2 * 128,
        experts=128,
        experts_per_token=8,
        expert_intermediate=768,
        moe_layers=48,
    ),
}


def from_transformer(t: Transformer, name: str) -> ModelShape:
    dense, moe = t.dense_layers, t.moe_layers
    linears = [*t.linears().values()] * dense + [*t.moe_linears().values()] * moe
    units = (t.layer_params() if dense else 0, t.moe_layer_params() if moe else 0, t.vocab * t.hidden)
    return ModelShape(
        params=t.total_params(),
        name=name,
        transformer=t,
        largest_unit=max(units),
        linear_params=sum(i * o for i, o in linears),
        lora_shapes=tuple(linears),
        largest_tensor=t.largest_matrix(),
        expert_params=t.expert_params(),
        experts=t.experts if moe else 0,
        active_params=t.active_params() if moe else 0,
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
    if "n_routed_experts" in config:
        raise UsageError(
            f"{name} is a DeepSeek-style mixture (n_routed_experts, latent attention), which the planner does not "
            "count; pass --params with --layers --hidden --heads --vocab instead."
        )
    optional = functools.partial(json_value, config, file=name, optional=True, minimum=1)
    kv_heads = optional("num_key_value_heads", (int, type(None)))
    tied = json_value(config, "tie_word_embeddings", (bool, type(None)), file=name, optional=True)
    head_dim = optional("head_dim", (int, type(None))) or 0
    t = Transformer(
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        heads=config["num_attention_heads"],
        kv_heads=kv_heads or config["num_attention_heads"],
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied_embeddings=bool(tied),
        explicit_head_dim=head_dim if head_dim * config["num_attention_heads"] != config["hidden_size"] else 0,
    )
    return from_transformer(replace(t, qk_norm=_qk_norm(config, t), **_mixture(config, name)), name)


def _qk_norm(config: dict[str, Any], t: Transformer) -> int:
    """Weights of a layer's query and key norms: Qwen3's over one head's width, OLMoE's over the whole widths."""
    kind = config.get("model_type")
    if kind in ("qwen3", "qwen3_moe"):
        return 2 * t.head_dim
    return t.q_hidden + t.kv_hidden if kind == "olmoe" else 0


def _mixture(config: dict[str, Any], name: str) -> dict[str, int]:
    """A mixture's fields of Transformer from a config.json: Qwen2/3-MoE's num_experts, moe_intermediate_size,
    decoder_sparse_step and mlp_only_layers, shared_expert_intermediate_size; Mixtral's and gpt-oss'
    num_local_experts (their experts as wide as intermediate_size, every layer a mixture). {} for a dense model."""
    optional = functools.partial(json_value, config, file=name, optional=True)
    experts = optional("num_experts", (int, type(None)), minimum=0) or optional(
        "num_local_experts", (int, type(None)), minimum=0
    )
    if not experts:
        return {}
    top_k = optional("num_experts_per_tok", (int, type(None)), minimum=1) or optional(
        "experts_per_token", (int, type(None)), minimum=1
    )
    if top_k is None or top_k > experts:
        raise UsageError(
            f"{name} has {experts} experts but num_experts_per_tok {top_k}; give the experts each token is routed "
            f"to, 1 to {experts}."
        )
    width = optional("moe_intermediate_size", (int, type(None)), minimum=1) or config["intermediate_size"]
    step = optional("decoder_sparse_step", (int, type(None)), minimum=1) or 1
    dense = set(config.get("mlp_only_layers") or ())  # often [], which json_value refuses as a list
    if not all(isinstance(layer, int) for layer in dense):
        optional("mlp_only_layers", list, items=int)  # refuses, naming the file and the key
    layers = config["num_hidden_layers"]
    moe = sum(1 for layer in range(layers) if layer not in dense and (layer + 1) % step == 0)
    shared = optional("shared_expert_intermediate_size", (int, type(None)), minimum=0) or 0
    return {
        "experts": experts,
        "experts_per_token": top_k,
        "expert_intermediate": width,
        "moe_layers": moe,
        "shared_expert_intermediate": shared,
    }


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
