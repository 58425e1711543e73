"""Bytes a Llama-style decoder keeps for backward, counted tensor by tensor as Hugging Face's implementation
(sdpa attention, RMSNorm computed in fp32, SwiGLU MLP) saves them. T = batch x sequence tokens.

Per layer, without checkpointing (measured tensor by tensor with saved_tensors_hooks, transformers 5 / torch 2.13):
  two RMSNorms        2*T*h*(4 + r) + 8*T   the fp32 input, the normalised output (residual dtype r), rsqrt
  linear inputs       n*T*h*c               the copy each linear after a norm keeps: 2 at full width, 5 under
                                            autocast (q, k, v, gate and up each cast their own)
  attention           T*c*(3h + 2kv)        q after rotary, k and v, sdpa's output (also o_proj's input)
                      + 4*b*heads*s         sdpa's fp32 logsumexp
  MLP                 4*T*i*c               gate, up, SiLU(gate), and down_proj's input
Outside the layers: token ids and labels (16T), the final norm and lm_head's input, and the fp32 log-softmax over
the vocabulary (4*T*V), which dominates small models with large vocabularies.
Under activation checkpointing (core/recompute.py's modes) a layer keeps
  full                only its input (T*h*r);
  selective           its input and the outputs of its matrix products and attention: q, k, v, sdpa's output and
                      logsumexp, o_proj, gate, up and down_proj (T*c*(4h + 2kv + 2i) + 4*b*heads*s);
  offload             nothing on the device: every saved tensor waits in host memory until backward needs it;
and backward brings the rest of one layer's activations back at a time (recomputed, or copied back), on top at
the peak.
Tensor and pipeline parallelism divide these per rank: see transformer_parts and layout.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.planner.shapes import Transformer


@dataclass(frozen=True)
class Activations:
    saved: int  # bytes held between forward and backward
    peak: int  # saved + what recomputation adds during backward


@dataclass(frozen=True)
class ActivationParts:
    """One micro-batch's bytes, in the pieces a model-parallel layout divides differently."""

    layer: int  # one decoder layer without checkpointing
    layer_input: int  # one decoder layer's input: all that full checkpointing keeps of it
    layer_products: int  # the outputs of its matrix products and attention, which selective keeps besides
    layer_gradients: int  # the gradients of the MLP's gate and up outputs, alive together in its backward
    outside: int  # token ids, labels, the final norm, the head's input and the log-softmax


def transformer_parts(
    t: Transformer, batch: int, seq: int, precision: str, tp: int = 1, sequence_parallel: bool = False
) -> ActivationParts:
    """`tp` divides what Megatron-style tensor parallelism splits: attention by heads and the MLP by its width.
    Without sequence parallelism the norms, the residual stream and each split linear's input stay whole on every
    rank, and the head's logits are gathered whole, so the log-softmax is whole too. Sequence parallelism divides
    the norms (the final one too) and a layer's input by tp; the split linears still keep the gathered input, and
    the head its gathered input and whole logits."""
    tokens = batch * seq
    compute = 4 if precision == "32" else 2
    residual = 2 if precision == "bf16-true" else 4
    mixed = precision in ("bf16-mixed", "fp16-mixed")
    h, kv, i = t.hidden, t.kv_hidden, t.intermediate
    positions = tp if sequence_parallel else 1  # what splits by position
    norms = 2 * tokens * h * (4 + residual) + 8 * tokens
    inputs = (5 if mixed else 2) * tokens * h * compute
    split = tokens * compute * (3 * h + 2 * kv) + 4 * batch * t.heads * seq + 4 * tokens * i * compute
    final_norm = tokens * h * (4 + residual) + 4 * tokens
    outside = 16 * tokens + -(-final_norm // positions) + tokens * h * compute + 4 * tokens * t.vocab
    layer = -(-norms // positions) + inputs + -(-split // tp)
    products = tokens * compute * (4 * h + 2 * kv + 2 * i) + 4 * batch * t.heads * seq
    layer_input = -(-tokens * h * residual // positions)
    gradients = -(-2 * tokens * i * compute // tp)
    return ActivationParts(layer, layer_input, -(-products // tp), gradients, outside)


def kept_per_layer(parts: ActivationParts, checkpointing: str) -> int:
    """Bytes one layer keeps on the device between its forward and its backward under `checkpointing`."""
    kept = {
        "none": parts.layer,
        "full": parts.layer_input,
        "selective": parts.layer_input + parts.layer_products,
        "offload": 0,
    }
    return kept[checkpointing]


def transformer_activations(t: Transformer, batch: int, seq: int, precision: str, checkpointing: str) -> Activations:
    parts = transformer_parts(t, batch, seq, precision)
    kept = kept_per_layer(parts, checkpointing)
    saved = t.layers * kept + parts.outside
    # Backward starts with the loss's: the gradients of the fp32 log-softmax and of the logits, each tokens x vocab.
    # It frees what lies outside the layers before it reaches the last layer, whose activations then come back.
    loss_backward = 2 * 4 * batch * seq * t.vocab
    return Activations(saved, max(saved + loss_backward, t.layers * kept + recomputed(parts, checkpointing)))


def recomputed(parts: ActivationParts, checkpointing: str) -> int:
    """Bytes a checkpointed layer's backward adds to what the layers keep: the rest of its activations, recomputed
    or copied back, and the gradients of its widest tensors."""
    return 0 if checkpointing == "none" else parts.layer - kept_per_layer(parts, checkpointing) + parts.layer_gradients
