"""What one GPU holds under tensor and pipeline parallelism: its slice of the weights and of the activations.

The layout is the mesh's (config/layout.py): pp outermost, then the data-parallel dimensions, tp innermost.
  tp   Megatron-style: q/k/v and MLP gate/up split by output columns, o/down by input rows, the embedding and the
       output head by vocabulary; norm weights stay whole, and so do the norms' and the residual stream's
       activations unless sequence parallelism splits those by position.
  pp   consecutive layers on consecutive ranks, the embedding on the first, the final norm and head on the last.
       With `stages_per_rank` v above 1 (interleaved, interleaved-zb) the layers form pp x v stages and rank r
       holds stages r, r + pp, ...; in a V (zbv, dualpipev) stages r and 2 pp - 1 - r (config/pipeline.py). The
       ranks differ, so the planner reports the one whose total binds.
A pipeline rank holds the activations of every micro-batch whose backward (a zero-bubble schedule's weight half)
has not run yet, in stage-sized chunks (1/v of a rank's layers), as torch's orders run them (the tests count them):
  gpipe           all forwards before any backward: every micro-batch of the step, on every rank;
  1f1b            rank r runs pp - r forwards before its first backward, so min(microbatches, pp - r);
  interleaved     Megatron's warm-up: 2 (pp - r - 1) + (v - 1) pp + 1 chunks, at most microbatches x v,
                  i.e. about pp + (pp - 1) / v micro-batches of a whole rank's layers on the first rank;
  interleaved-zb  min(k, pp) v + max(0, k - pp) (v - 1) chunks on every rank, k the micro-batches of a round;
  zbv             min(2 pp, m + 1 + r, 2 m) chunks: pp micro-batches, 1f1b's first rank's, on every rank;
  dualpipev       2 pp + 1 chunks (m >= 2 pp): half a micro-batch more than zbv.
Pure arithmetic on a ModelShape; nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from multigpu.config.pipeline import LOOPED, ZERO_BUBBLE, stage_layers, stage_owners
from multigpu.core.errors import UsageError
from multigpu.planner.activations import layer_parts, layers_kept, transformer_parts
from multigpu.planner.shapes import ModelShape

COLUMN_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # the rest (o_proj, down_proj) split rows


@dataclass(frozen=True)
class Stage:
    """One pipeline rank: the decoder layers it holds, whether it holds the embedding (first) or the final norm
    and head (last), and how many micro-batches of its layers' activations it keeps at its peak."""

    rank: int
    layers: int
    first: bool
    last: bool
    in_flight: float


def micro_batches_in_flight(schedule: str, pp: int, rank: int, stages_per_rank: int, microbatches: int) -> float:
    """The micro-batches of a whole rank's layers whose activations rank `rank` keeps at its peak (see the module's
    docstring); a zero-bubble schedule's counted until each one's weight half has run."""
    if pp == 1:
        return 1.0  # no pipeline: gradient accumulation finishes each micro-batch's backward before the next
    m, v = microbatches, stages_per_rank
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    if schedule == "zbv":
        return min(2 * pp, m + 1 + rank, 2 * m) / 2
    if schedule == "dualpipev":
        return min(2 * pp + 1, 2 * m) / 2
    if schedule == "interleaved-zb":
        per_round = m // max(1, m // pp)
        return (min(per_round, pp) * v + max(0, per_round - pp) * (v - 1)) / v
    chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
    return chunks / v


def pipeline_stages(
    layers: int, pp: int, stages_per_rank: int, schedule: str, microbatches: int, split: str | None = None
) -> list[Stage]:
    """Every pipeline rank's share: `split`'s layers per stage (pp_split), else as even as they allow; in a V
    (zbv, dualpipev) rank 0 holds the last stage as well as the first. `layers` 0 (a model without known layers)
    splits nothing but the in-flight count; the caller divides its parameters evenly instead."""
    count = pp * stages_per_rank
    if layers and count > layers:
        raise UsageError(
            f"pp_size {pp} x {stages_per_rank} stage(s) per rank makes {count} pipeline stages for the model's "
            f"{layers} layers; choose a pp_size (and pp_stages_per_rank) whose product is at most {layers}."
        )
    if split is not None and not layers:
        raise UsageError(f"pp_split {split} counts the model's layers, which --params alone do not give; add --layers.")
    per_stage = [len(stage) for stage in stage_layers(layers, count, split)] if layers else [0] * count
    owners = stage_owners(schedule, pp, stages_per_rank)
    return [
        Stage(
            rank=rank,
            layers=sum(n for n, owner in zip(per_stage, owners, strict=True) if owner == rank),
            first=rank == owners[0],
            last=rank == owners[-1],
            in_flight=micro_batches_in_flight(schedule, pp, rank, stages_per_rank, microbatches),
        )
        for rank in range(pp)
    ]


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1, schedule: str = "1f1b") -> float:
    """The share of a pipelined step each rank sits idle, a forward, a backward's input half and its weight half
    taking alike (the zero-bubble paper's assumption; a whole backward is two forwards). GPipe and 1F1B fill and drain
    alike, (pp - 1) / (m + pp - 1) (1F1B saves memory, not time); interleaving v stages per rank shortens the fill
    v-fold. The zero-bubble schedules idle `idle_chunks` forwards of one stage beside the 3 v m of their work, which
    the tests check against a step-by-step run of torch's own orders."""
    if pp <= 1:
        return 0.0
    v, m = stages_per_rank, microbatches
    if schedule in ZERO_BUBBLE:
        idle = idle_chunks(schedule, pp, v, m)
        return idle / (3 * v * m + idle)
    if schedule not in LOOPED:
        v = 1
    return (pp - 1) / (v * m + pp - 1)


def idle_chunks(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> int:
    """How long each rank of a zero-bubble schedule idles in a step, in forwards of one stage: the fill and drain
    that its weight halves cannot cover, longer when there are too few micro-batches to cover them."""
    v, m = stages_per_rank, microbatches
    if schedule == "dualpipev":
        return 2 * (pp - 1)
    if schedule == "zbv":
        return max(pp - 1, 4 * (pp - 1) - 2 * (m - 1))
    per_round = m // max(1, m // pp)  # interleaved-zb
    return (pp - 1) + v * max(0, pp - per_round) + (v - 1) * max(0, pp - 2 * per_round)


def _split_lora(linears: dict[str, tuple[int, int]], tp: int) -> tuple[tuple[int, int], ...]:
    """A layer's LoRA (in, out) pairs as one tp rank holds them: the split side of each projection divided."""
    return tuple((i, o // tp) if name in COLUMN_SPLIT else (i // tp, o) for name, (i, o) in linears.items())


def held_shape(shape: ModelShape, tp: int, pp: int, stage: Stage, ep: int = 1) -> ModelShape:
    """The part of the model one rank holds, as a ModelShape the memory arithmetic reads like a whole model.

    `ep`: a mixture's routed experts split over an ep group, 1/ep of each layer's on a rank (the router, attention
    and any shared expert stay whole). tp splits attention and dense MLPs, not experts: each tp rank holds its
    experts whole."""
    if tp == 1 and pp == 1 and ep == 1:
        return shape
    t = shape.transformer
    if t is None:
        # Without a layer structure the weights are taken as evenly divisible over tp x pp (and the experts over
        # ep, the largest unit shrinking in proportion).
        share = 1 / (tp * pp)
        params = (shape.params - shape.expert_params) * share + shape.expert_params * share / ep
        unit = (shape.largest_unit or shape.params // 10) * params / (shape.params * share) / tp
        return replace(
            shape,
            params=max(1, math.ceil(params)),
            linear_params=math.ceil(shape.linear_params * share),
            largest_unit=math.ceil(unit),
            largest_tensor=math.ceil(shape.largest_tensor / tp),
            trainable=None if shape.trainable is None else math.ceil(shape.trainable * params / shape.params),
            lora_shapes=shape.lora_shapes[: math.ceil(len(shape.lora_shapes) / pp)],
            activation_bytes_per_sample=shape.activation_bytes_per_sample / pp,
            expert_params=math.ceil(shape.expert_params * share / ep),
        )
    dense, moe = t.layer_kinds(stage.layers)
    norms = 2 * t.hidden + t.qk_norm  # whole on every tp rank
    dense_linear = sum(i * o for i, o in t.linears().values()) // tp
    moe_linear = sum(i * o for i, o in t.moe_linears().values()) // tp
    experts = t.layer_experts() // ep
    router = t.moe_layer_params() - sum(i * o for i, o in t.moe_linears().values()) - t.layer_experts() - norms
    units = (dense_linear + norms if dense else 0, moe_linear + experts + router + norms if moe else 0)
    vocab_slice = t.vocab * t.hidden // tp
    # A tied head shares the embedding's storage when one rank holds both; across pipeline ranks each keeps a copy.
    head = 0 if t.tied_embeddings and pp == 1 else vocab_slice
    params = dense * units[0] + moe * units[1] + (vocab_slice if stage.first else 0)
    params += (head + t.hidden) if stage.last else 0
    fused = t.experts * 2 * t.expert_intermediate * t.hidden // ep if moe else 0  # experts' gate_up_proj
    largest_linear = max(i * o for i, o in t.linears().values()) // tp
    return replace(
        shape,
        params=params,
        linear_params=dense * dense_linear + moe * moe_linear,
        largest_unit=max(*units, vocab_slice if stage.first or stage.last else 0),
        largest_tensor=max(1, vocab_slice, largest_linear, fused),
        lora_shapes=_split_lora(t.linears(), tp) * dense + _split_lora(t.moe_linears(), tp) * moe,
        expert_params=moe * experts,
    )


def stage_activations(
    shape: ModelShape,
    stage: Stage,
    tp: int,
    batch: int,
    seq: int,
    precision: str,
    checkpointing: str,
    sequence_parallel: bool = False,
    cp: int = 1,
    cp_method: str = "ulysses",
    ep: int = 1,
) -> float:
    """Bytes of activations on one rank at its peak: its in-flight micro-batches, each `batch` sequences (seq / cp
    positions of each under context parallelism)."""
    t = shape.transformer
    if t is None:
        # per-rank bytes from held_shape; a measured sample's positions are taken to split evenly over cp
        return shape.activation_bytes_per_sample * batch * stage.in_flight / cp
    kinds = layer_parts(t, stage.layers, batch, seq, precision, tp, sequence_parallel, cp, cp_method, ep=ep)
    outside = transformer_parts(t, batch, seq, precision, tp, sequence_parallel, cp, cp_method).outside
    # Checkpointing brings the rest of one layer's activations back at a time in backward: on top, once.
    kept, recompute = layers_kept(kinds, checkpointing)
    return (kept + (outside if stage.last else 0)) * stage.in_flight + recompute
