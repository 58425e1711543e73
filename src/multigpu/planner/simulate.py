"""Predicts how data-parallel training scales to G GPUs: step time, throughput and scaling efficiency.

Pure arithmetic, no process group. The input is the compute time of one training step on one device at a fixed
per-device batch (weak scaling: the per-device batch stays constant as GPUs are added); each strategy's collectives
are costed with an alpha-beta model (time = hops · alpha + bytes on the wire / bandwidth) and overlapped with
compute as far as that strategy allows.

Links: every `Link.bandwidth_Bps` is a bus bandwidth per GPU in the nccl-tests sense, the figure that nccl-tests and
`multigpu bench --collectives` print, so a preset and a calibrated link mean the same thing. `interconnect` names
the fabric between nodes and `intra` (default nvlink) the one inside a node: a run within one node uses `intra`
alone; a collective that spans nodes runs at the slower of the two bandwidths and pays the inter-node latency on
every hop (pessimistic: in NCCL's rings only the hops that leave a node pay it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multigpu.core.errors import UsageError
from multigpu.planner.context_cost import cp_comm
from multigpu.planner.expert_cost import ep_comm, parameter_groups
from multigpu.planner.links import (  # noqa: F401  (re-exported: the simulator's importers find the links here)
    INTERCONNECTS,
    OPS,
    Link,
    Links,
    all_gather,
    all_reduce,
    all_to_all,
    hops_and_factor,
    per_op,
    reduce_scatter,
    ring_time,
    shared_link,
    span_link,
    span_links,
    tree_all_reduce,
)
from multigpu.planner.model_parallel import bubble_fraction
from multigpu.planner.simulate_config import SimulateConfig
from multigpu.strategies.facts import REDUCE_SCATTER
from multigpu.transforms.recompute import FORWARD_RUN_AGAIN

if TYPE_CHECKING:
    from multigpu.planner.shapes import ModelShape


@dataclass(frozen=True)
class Prediction:
    gpus: int
    nodes: int
    step_s: float
    compute_s: float
    comm_s: float  # every collective of the step, hidden or not
    exposed_comm_s: float  # the part compute does not hide
    throughput: float  # units per second, all GPUs
    per_gpu_throughput: float
    speedup: float  # throughput over one GPU's
    efficiency: float  # speedup / gpus
    unit: str = "samples"
    bubble_s: float = 0.0  # the pipeline's fill and drain: time each rank waits
    all_to_all_s: float = 0.0  # of comm_s, expert parallelism's dispatch and combine (all exposed)


def overlapped(times: list[float], backward_s: float, overlap: bool) -> tuple[float, float]:
    """(total, exposed) for buckets reduced in turn as backward produces them."""
    comm = sum(times)
    # Every bucket but the last can run under the remaining backward; the last is ready only when backward ends.
    return comm, max(comm - backward_s, times[-1]) if overlap else comm


def strategy_comm(
    config: SimulateConfig, n: int, links: Link | Links, compute_s: float, replicas: tuple[int, Link] | None = None
) -> tuple[float, float]:
    """(total, exposed) communication seconds of one step on n ranks. `replicas`: hybrid sharding's (count, link)
    across which each unit's gradient shard is all-reduced after its reduce-scatter over the n shard ranks."""
    links = per_op(links)
    if n <= 1 and replicas is None:
        return 0.0, 0.0
    grads = config.params * config.grad_bytes if config.grad_payload is None else config.grad_payload
    weights = config.params * config.param_bytes
    backward = config.backward_fraction * compute_s
    communication = config.communication
    if not communication.per_unit:  # gradients reduced in buckets as backward makes them (ddp, zero1, zero2)
        full, rest = divmod(grads, config.bucket_mb * 2**20)
        sizes = [config.bucket_mb * 2**20] * int(full) + ([rest] if rest else [])
        op = communication.gradients
        cost = reduce_scatter if op == REDUCE_SCATTER else all_reduce
        comm, exposed = overlapped([cost(n, size, links[op]) for size in sizes], backward, config.overlap)
        if communication.gathers_after_step:  # updated shards gathered after the step: nothing left to hide them
            gather = all_gather(n, weights, links["all_gather"])
            comm, exposed = comm + gather, exposed + gather
        return comm, exposed
    # zero3 / fsdp: each unit is gathered for forward and again for backward, its gradients scattered in backward.
    gather = all_gather(n, weights / config.layers, links["all_gather"])
    scatter = reduce_scatter(n, grads / config.layers, links["reduce_scatter"])
    if replicas is not None:  # FSDP2 all-reduces the reduce-scattered shard over the replicas, in the same window
        scatter += all_reduce(replicas[0], grads / n / config.layers, replicas[1])
    comm = config.layers * (2 * gather + scatter)
    if not config.overlap:
        return comm, comm
    forward_unit = (1 - config.backward_fraction) * compute_s / config.layers
    backward_unit = backward / config.layers
    # With prefetch, unit i+1's gather runs under unit i's compute; in backward the next gather and the previous
    # scatter share the window. Nothing hides the first gather nor the last scatter.
    hidden_shortfall = max(0.0, gather - forward_unit) + max(0.0, gather + scatter - backward_unit)
    # At most all of it: with little compute per unit (a few units, a slow link) the sum would count the first
    # gather and the last scatter twice, once on their own and once in their unit's shortfall.
    return comm, min(comm, gather + scatter + config.layers * hidden_shortfall)


def simulate(
    config: SimulateConfig, intra: Link | Links | None = None, inter: Link | Links | None = None
) -> list[Prediction]:
    """One Prediction per entry of config.gpus. `intra`/`inter` (e.g. from load_calibration) replace the presets."""
    intra = per_op(intra or INTERCONNECTS[config.intra])
    inter = per_op(inter or INTERCONNECTS[config.interconnect])
    single = config.compute_s  # one process never oversubscribes a slot, and talks to no one
    predictions = []
    for n in config.gpus:
        per_node = min(n, config.gpus_per_node)
        slots = config.compute_slots_per_node
        compute = config.compute_s * (per_node / slots if slots and per_node > slots else 1.0)
        bubble, replicas, all_to_all_s = 0.0, config.dims(n).data_parallel_size, 0.0
        if config.replica_span == 1 and config.ep_size == 1:
            comm, exposed = data_parallel_step(config, n, intra, inter, compute)
        else:
            compute /= config.replica_span
            comm, exposed, bubble, all_to_all_s = layout_step(config, n, intra, inter, compute)
        step = compute + exposed + bubble
        speedup = replicas * single / step
        predictions.append(
            Prediction(
                gpus=n,
                nodes=-(-n // config.gpus_per_node),
                step_s=step,
                compute_s=compute,
                comm_s=comm,
                exposed_comm_s=exposed,
                throughput=replicas * config.units_per_step / step,
                per_gpu_throughput=replicas * config.units_per_step / step / n,
                speedup=speedup,
                efficiency=speedup / n,
                unit=config.unit,
                bubble_s=bubble,
                all_to_all_s=all_to_all_s,
            )
        )
    return predictions


def data_parallel_step(
    config: SimulateConfig, n: int, intra: Links, inter: Links, compute: float
) -> tuple[float, float]:
    """(comm, exposed comm) seconds of one step of a data-parallel strategy alone on n GPUs. Replicas across nodes
    with shards inside each (hsdp's layout) run the shards' collectives over the node's link and all-reduce each
    unit's gradient shard across the nodes; a node's shard ranks run those all-reduces at once, each over its share
    of the node's link. Every other layout spreads its collectives over all n GPUs."""
    dims = config.dims(n)
    gpn = config.gpus_per_node
    if dims.replicate == 1:
        return strategy_comm(config, n, span_links(n, gpn, intra, inter), compute)
    across = shared_link(span_link(n, gpn, intra["all_reduce"], inter["all_reduce"]), min(dims.shard, gpn))
    return strategy_comm(
        config, dims.shard, span_links(dims.shard, gpn, intra, inter), compute, (dims.replicate, across)
    )


@dataclass(frozen=True)
class MixedPrediction:
    """Data parallelism over GPUs of different speeds: a step with every GPU given the same batch (even), and one
    with each GPU given a share of the same global batch in proportion to its speed (balanced)."""

    tflops: tuple[float, ...]  # each GPU's peak
    shares: tuple[float, ...]  # balanced: each GPU's fraction of the global batch
    even: Prediction
    balanced: Prediction

    @property
    def speedup(self) -> float:
        return self.even.step_s / self.balanced.step_s


def simulate_mixed(
    config: SimulateConfig, tflops: list[float], intra: Link | Links | None = None, inter: Link | Links | None = None
) -> MixedPrediction:
    """`config.compute_s`: one device's step at the per-device batch on the fastest GPU (the largest of `tflops`).
    The collectives carry the same bytes either way; what changes is the compute they wait for: even shares wait for
    the slowest GPU, balanced ones finish together, each GPU's compute the global batch's over the summed speed."""
    speeds = [peak / max(tflops) for peak in tflops]
    n = len(speeds)

    def step(compute_s: float) -> Prediction:
        return simulate(dataclasses.replace(config, compute_s=compute_s, gpus=(n,)), intra, inter)[0]

    even = step(config.compute_s / min(speeds))
    balanced = step(config.compute_s * n / sum(speeds))
    return MixedPrediction(tuple(tflops), tuple(speed / sum(speeds) for speed in speeds), even, balanced)


def layout_step(config: SimulateConfig, n: int, intra: Links, inter: Links, compute: float) -> tuple[float, ...]:
    """(comm, exposed comm, bubble, all-to-all) seconds of one step of one GPU under tp x pp x cp x data parallel
    (x ep), `compute` being that GPU's share of the replica's compute.

    tp: per layer, 2 all-reduces of a micro-batch's tokens x hidden activations in forward and 2 in backward (2 more
    when full checkpointing recomputes the forward), on the critical path unless tp_overlap.
    pp: a micro-batch's activations go forward and its gradients back once per stage; sends overlap the next
    micro-batch's compute, except on the fill and drain, where each boundary waits for them. The bubble is
    (pp - 1) / (v m + pp - 1) of the pipelined time, less under a zero-bubble schedule
    (planner.layout.bubble_fraction).
    cp: see cp_comm.
    ep: see ep_comm; all exposed.
    dp: the data-parallel strategy's collectives over n / (tp x pp) ranks (cp's ranks reduce their gradients
    together with the data-parallel ones) on the rank's own parameters; under ep the experts' over the ranks
    holding the same slice of them (expert_cost.parameter_groups), each group hidden under its share of the
    compute, in proportion to its parameters. Every tp rank runs its own dp (and pp) traffic at once, so across
    nodes each gets 1/tp of the node's NICs.
    """
    tp, pp, gpn = config.tp_size, config.pp_size, config.gpus_per_node
    dp, m, v = config.dims(n).data_parallel_size, config.microbatches or 1, config.pp_stages_per_rank
    micro_batch = config.units_per_step * config.tokens_per_unit / m * config.hidden * config.activation_bytes
    layers = config.layers / pp
    tp_link = span_link(tp, gpn, intra["all_reduce"], inter["all_reduce"])
    per_layer = 4 + 2 * FORWARD_RUN_AGAIN[config.activation_checkpointing]
    tp_comm = per_layer * layers * m * all_reduce(tp, micro_batch, tp_link)
    tp_exposed = max(0.0, tp_comm - compute) if config.tp_overlap else tp_comm
    pp_comm = pp_exposed = 0.0
    if pp > 1:
        crosses = tp * dp >= gpn  # the next stage's ranks lie on another node
        link = shared_link(inter["all_reduce"], gpn) if crosses else intra["all_reduce"]
        send = link.alpha_s + micro_batch / link.bandwidth_Bps
        pp_comm, pp_exposed = 2 * v * m * send, 2 * (v * pp - 1) * send
    cp_comm_s, cp_exposed = cp_comm(config, intra, inter, compute)
    ep_comm_s, ep_exposed = ep_comm(config, intra, inter)
    busy = compute + tp_exposed + cp_exposed + ep_exposed
    fraction = bubble_fraction(pp, m, v, config.pp_schedule)
    bubble = busy * fraction / (1 - fraction)
    dp_comm, dp_exposed = data_parallel_comm(config, dp, layers, intra, inter, compute)
    comm = tp_comm + pp_comm + cp_comm_s + ep_comm_s + dp_comm
    return comm, tp_exposed + pp_exposed + cp_exposed + ep_exposed + dp_exposed, bubble, ep_comm_s


def data_parallel_comm(
    config: SimulateConfig, dp: int, layers: float, intra: Links, inter: Links, compute: float
) -> tuple[float, float]:
    """(comm, exposed comm) seconds of the data-parallel strategy's collectives of one GPU under a tp x pp x cp
    (x ep) layout of `dp` replicas, each group of ranks reducing the same parameters costed as a run of its own
    whose compute is its share of `compute` (see layout_step)."""
    tp, gpn = config.tp_size, config.gpus_per_node
    dp_comm = dp_exposed = 0.0
    reducing = dp * config.cp_size
    groups = parameter_groups(config, reducing)
    share = min(tp, gpn)
    links = {op: span_link(reducing, max(1, gpn // tp), intra[op], shared_link(inter[op], share)) for op in OPS}
    for params, ranks in groups:
        if ranks == 1:
            continue
        part = params / sum(held for held, _ in groups)
        rank = dataclasses.replace(
            config,
            params=math.ceil(params),
            grad_payload=None if config.grad_payload is None else config.grad_payload / config.model_parallel * part,
            layers=max(1, math.ceil(layers)),
            gpus=(ranks,),
            tp_size=1,
            pp_size=1,
            cp_size=1,
            ep_size=1,
            pp_schedule="1f1b",
            pp_stages_per_rank=1,
            microbatches=None,
        )
        comm, exposed = strategy_comm(rank, ranks, links, compute * part)
        dp_comm, dp_exposed = dp_comm + comm, dp_exposed + exposed
    return dp_comm, dp_exposed


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token: 6·params (forward 2, backward 4 per weight; a mixture's active ones, those a
    token is routed through) + 12·layers·width·seq_len for attention's score and value matmuls (width: heads x
    head_dim), which hold no weights (the estimate behind the usual MFU figure). Without a transformer's
    dimensions, 6·params alone."""
    if seq_len < 1:
        raise UsageError(f"--seq-len must be 1 or more (got {seq_len}).")
    t = shape.transformer
    return 6.0 * shape.active + (12.0 * t.layers * t.q_hidden * seq_len if t else 0.0)


def compute_time(flops_per_unit: float, units_per_step: float, tflops: float, mfu: float) -> float:
    """Seconds per step when not measured: FLOPs of the step over peak TFLOPS at the given utilisation."""
    if not 0 < tflops < math.inf or not 0 < mfu <= 1:
        raise UsageError(f"--tflops must be positive and --mfu in (0, 1] (got {tflops:g} and {mfu:g}).")
    return flops_per_unit * units_per_step / (tflops * 1e12 * mfu)
