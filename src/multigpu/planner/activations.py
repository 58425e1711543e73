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
Under activation checkpointing (transforms/recompute.py's modes) a layer keeps
  full                only its input (T*h*r);
  selective           its input and the outputs of its matrix products and attention: q, k, v, sdpa's output and
                      logsumexp, o_proj, gate, up and down_proj (T*c*(4h + 2kv + 2i) + 4*b*heads*s);
  offload             nothing on the device: every saved tensor waits in host memory until backward needs it;
and backward brings the rest of one layer's activations back at a time (recomputed, or copied back), on top at
the peak.
A mixture-of-experts layer (Hugging Face's Qwen3-MoE, Mixtral, OLMoE: each expert runs on the tokens routed to it)
keeps, in place of the dense MLP, per routed token (T*k, k experts per token)
  dispatch and combine  2*T*k*h*c           each expert's input rows and its output rows (weighted by the router)
  expert MLP            4*T*k*e*c           gate, up, SiLU(gate) and down_proj's input, e the expert's width
  router                4*T*E               the fp32 softmax over the E experts
and its linear inputs are q, k, v and the router's under autocast (4); a shared expert adds a dense MLP's. Routing
is taken as balanced (each expert, each ep rank, gets its share of T*k; a skewed router holds more on some ranks).
Under expert parallelism the dispatch and combine all-to-alls add their send and receive buffers (2*T*k*h*c), one
layer at a time, on top at the peak. tp does not split experts: each tp rank runs every routed token.
Tensor and pipeline parallelism divide these per rank: see transformer_parts and layout.py.
Context parallelism (cp ranks, each holding seq / cp positions of every sequence) divides every T above by cp.
Attention differs by method (attention_saved):
  ulysses             all-to-alls turn q, k and v from (B, heads, S/cp, D) into (B, heads/cp, S, D), whole
                      sequences of a slice of the heads, which sdpa saves; its output and logsumexp are alike, and
                      the output goes back to (B, S/cp, heads, D) for o_proj. Per rank that is the same bytes divided
                      by cp, unless the heads do not divide: the binding rank takes ceil(heads/cp), and key/value
                      heads that cp does not divide are repeated to the query heads first (GQA's saving lost).
                      In backward one layer at a time adds sdpa's gradients of q, k, v over whole sequences and
                      their all-to-all'd copies (attention_buffers).
  ring                q, k, v, the output and logsumexp stay at the rank's positions; backward adds the key/value
                      blocks and their gradients in flight from the neighbouring rank.
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
    cp_buffers: int = 0  # what cp's attention holds besides, one layer at a time in backward
    ep_buffers: int = 0  # the all-to-alls' send and receive buffers of a mixture layer under ep, one at a time


def transformer_parts(
    t: Transformer,
    batch: int,
    seq: int,
    precision: str,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    cp_method: str = "ulysses",
    moe: bool = False,
    ep: int = 1,
) -> ActivationParts:
    """One layer's parts: a dense layer's, or (`moe`) a mixture-of-experts layer's under expert parallelism `ep`.

    `tp` divides what Megatron-style tensor parallelism splits: attention by heads and the MLP by its width.
    Without sequence parallelism the norms, the residual stream and each split linear's input stay whole on every
    rank, and the head's logits are gathered whole, so the log-softmax is whole too. Sequence parallelism divides
    the norms (the final one too) and a layer's input by tp; the split linears still keep the gathered input, and
    the head its gathered input and whole logits.

    `cp` divides every position: a rank holds seq / cp tokens of each sequence through the norms, the MLP, the
    residual stream, the head and the log-softmax; attention is counted by `attention_saved`."""
    tokens = batch * seq // cp
    compute = 4 if precision == "32" else 2
    residual = 2 if precision == "bf16-true" else 4
    mixed = precision in ("bf16-mixed", "fp16-mixed")
    h, i = t.hidden, t.intermediate
    positions = tp if sequence_parallel else 1  # what splits by position
    if moe:
        i = t.shared_expert_intermediate  # the dense MLP a mixture layer keeps, if any
    norms = 2 * tokens * h * (4 + residual) + 8 * tokens
    casts = (2 if i else 0) + (4 if moe else 3)  # q, k, v (and the router) each cast their own, gate and up too
    inputs = (casts if mixed else 2) * tokens * h * compute
    attention = attention_saved(t, batch, seq, compute, tp, cp, cp_method)
    split = -(-4 * tokens * i * compute // tp) + attention
    final_norm = tokens * h * (4 + residual) + 4 * tokens
    outside = 16 * tokens + -(-final_norm // positions) + tokens * h * compute + 4 * tokens * t.vocab
    layer = -(-norms // positions) + inputs + split
    # selective keeps what attention saves and the outputs of o_proj, gate, up and down_proj.
    products = attention + -(-tokens * compute * (h + 2 * i) // tp)
    layer_input = -(-tokens * h * residual // positions)
    gradients = -(-2 * tokens * i * compute // tp)
    buffers = attention_buffers(t, batch, seq, compute, tp, cp, cp_method)
    routed, e = tokens * t.experts_per_token, t.expert_intermediate
    if not moe:
        return ActivationParts(layer, layer_input, products, gradients, outside, buffers)
    # The experts' rows in and out, their MLPs, and the router's fp32 softmax; selective keeps the router's logits
    # and the experts' gate, up and down outputs.
    experts = routed * compute * (2 * h + 4 * e) + 4 * tokens * t.experts
    kept = tokens * compute * t.experts + routed * compute * (2 * e + h)
    dispatch = 2 * routed * h * compute if ep > 1 else 0
    return ActivationParts(
        layer + experts, layer_input, products + kept, gradients + 2 * routed * e * compute, outside, buffers, dispatch
    )


def attention_heads(t: Transformer, tp: int, cp: int) -> tuple[int, int]:
    """(query heads, key/value heads) one rank's attention runs under Ulysses: tp's share of each, spread over
    cp (uneven heads: the binding rank takes the larger share); key/value heads that cp does not divide are
    repeated to the query heads first, so each rank holds as many of them as of the queries."""
    heads, kv_heads = t.heads // tp, t.kv_heads // tp
    local = -(-heads // cp)
    return local, kv_heads // cp if kv_heads % cp == 0 else local


def attention_saved(t: Transformer, batch: int, seq: int, compute: int, tp: int, cp: int, method: str) -> int:
    """What one layer's attention keeps for backward on one rank: q (after rotary), k and v as sdpa reads them,
    sdpa's output and fp32 logsumexp, and o_proj's input (sdpa's output brought back to the rank's positions).
    Ring attention holds its own positions of all of them; Ulysses holds whole sequences of its heads."""
    d, tokens = t.head_dim, batch * seq // cp
    heads, kv_heads = t.heads // tp, t.kv_heads // tp
    o_proj_input = tokens * heads * d * compute
    if method == "ring" or cp == 1:
        return tokens * d * compute * (2 * heads + 2 * kv_heads) + o_proj_input + 4 * tokens * heads
    q, kv = attention_heads(t, tp, cp)
    return batch * seq * d * compute * (2 * q + 2 * kv) + o_proj_input + 4 * batch * q * seq


def attention_buffers(t: Transformer, batch: int, seq: int, compute: int, tp: int, cp: int, method: str) -> int:
    """What a layer's attention holds besides under cp, one layer at a time in backward. Ulysses: sdpa's
    gradients of q, k and v over whole sequences of the rank's heads and their all-to-all'd copies at the rank's
    positions. Ring: the key/value blocks (and their gradients) arriving from the next rank while the current
    ones are used."""
    if cp == 1:
        return 0
    d, tokens = t.head_dim, batch * seq // cp
    heads, kv_heads = t.heads // tp, t.kv_heads // tp
    if method == "ring":
        return 4 * tokens * kv_heads * d * compute
    q, kv = attention_heads(t, tp, cp)
    return batch * seq * d * compute * (q + 2 * kv) + tokens * d * compute * (heads + 2 * kv_heads)


def kept_per_layer(parts: ActivationParts, checkpointing: str) -> int:
    """Bytes one layer keeps on the device between its forward and its backward under `checkpointing`."""
    kept = {
        "none": parts.layer,
        "full": parts.layer_input,
        "selective": parts.layer_input + parts.layer_products,
        "offload": 0,
    }
    return kept[checkpointing]


def layer_parts(
    t: Transformer,
    layers: int,
    batch: int,
    seq: int,
    precision: str,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    cp_method: str = "ulysses",
    ep: int = 1,
) -> list[tuple[int, ActivationParts]]:
    """(how many, parts) of each kind of layer among `layers` of the model's (t.layer_kinds): the dense layers',
    then the mixture layers'."""
    dense, moe = t.layer_kinds(layers)
    common = (t, batch, seq, precision, tp, sequence_parallel, cp, cp_method)
    kinds = ((dense, transformer_parts(*common)), (moe, transformer_parts(*common, moe=True, ep=ep)))
    return [(count, parts) for count, parts in kinds if count]


def layers_kept(kinds: list[tuple[int, ActivationParts]], checkpointing: str) -> tuple[int, int]:
    """(bytes the layers keep between forward and backward, what one layer's backward adds on top at most)."""
    kept = sum(count * kept_per_layer(parts, checkpointing) for count, parts in kinds)
    return kept, max((recomputed(parts, checkpointing) for _, parts in kinds), default=0)


def transformer_activations(
    t: Transformer,
    batch: int,
    seq: int,
    precision: str,
    checkpointing: str,
    cp: int = 1,
    cp_method: str = "ulysses",
    ep: int = 1,
) -> Activations:
    kinds = layer_parts(t, t.layers, batch, seq, precision, cp=cp, cp_method=cp_method, ep=ep)
    kept, recompute = layers_kept(kinds, checkpointing)
    saved = kept + kinds[0][1].outside
    # Backward starts with the loss's: the gradients of the fp32 log-softmax and of the logits, each tokens x vocab.
    # It frees what lies outside the layers before it reaches the last layer, whose activations then come back.
    loss_backward = 2 * 4 * batch * seq // cp * t.vocab
    return Activations(saved, max(saved + loss_backward, kept + recompute))


def recomputed(parts: ActivationParts, checkpointing: str) -> int:
    """Bytes a layer's backward adds to what the layers keep: under checkpointing the rest of its activations,
    recomputed or copied back, and the gradients of its widest tensors; under cp, its attention's buffers; under
    ep, its all-to-alls' buffers."""
    buffers = parts.cp_buffers + parts.ep_buffers
    if checkpointing == "none":
        return buffers
    return parts.layer - kept_per_layer(parts, checkpointing) + parts.layer_gradients + buffers
