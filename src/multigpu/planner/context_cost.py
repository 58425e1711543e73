"""What context parallelism's attention costs on the wire in one training step (simulate.py's layout_step adds it).
Pure arithmetic."""

from __future__ import annotations

from multigpu.planner.links import Links, all_to_all, span_link
from multigpu.planner.simulate_config import SimulateConfig
from multigpu.transforms.recompute import FORWARD_RUN_AGAIN


def cp_comm(config: SimulateConfig, intra: Links, inter: Links, compute: float) -> tuple[float, float]:
    """(comm, exposed) seconds of cp's traffic in one step of one GPU holding tokens / cp of each micro-batch.

    ulysses: per layer 4 all-to-alls in forward (q, k, v from positions to heads, the output back) and 4 in
    backward (their gradients), 4 more when full checkpointing runs the forward again; each moves (cp - 1) / cp of
    the rank's tokens x width (k and v narrower under GQA, unless cp does not divide their heads and they are
    repeated to the query heads). Nothing overlaps them: attention waits for its inputs.
    ring: per layer cp - 1 exchanges of the rank's keys and values with its neighbours in forward, and cp - 1 of
    keys, values and their gradients (twice the bytes) in backward; each runs under the attention of the block in
    hand (1 / cp of the layer's), so a step costs max(exchange, block compute).
    cp's ranks are consecutive after tp's: they share a node while tp x cp fits one."""
    cp, tp = config.cp_size, config.tp_size
    if cp == 1:
        return 0.0, 0.0
    m, layers = config.microbatches or 1, config.layers / config.pp_size
    tokens = config.units_per_step * config.tokens_per_unit / (cp * m)  # one micro-batch's, on this rank
    heads, kv_heads = config.heads // tp, config.kv_heads // tp
    q_width = config.hidden / tp
    kv_width = q_width * kv_heads / heads
    link = span_link(tp * cp, config.gpus_per_node, intra["all_gather"], inter["all_gather"])
    forwards = 1 + FORWARD_RUN_AGAIN[config.activation_checkpointing]
    if config.cp_method == "ulysses":
        moved = kv_width if kv_heads % cp == 0 else q_width
        sizes = [q_width, moved, moved, q_width]
        once = sum(all_to_all(cp, tokens * width * config.activation_bytes, link) for width in sizes)
        comm = (forwards + 1) * layers * m * once
        return comm, comm
    exchange = link.alpha_s + tokens * 2 * kv_width * config.activation_bytes / link.bandwidth_Bps
    attention = compute * config.attention_fraction / (layers * m)  # one micro-batch's attention in one layer
    forward_block = attention * (1 - config.backward_fraction) / cp
    backward_block = attention * config.backward_fraction / cp
    steps = (cp - 1) * layers * m
    comm = steps * (forwards * exchange + 2 * exchange)
    exposed = steps * (forwards * max(0.0, exchange - forward_block) + max(0.0, 2 * exchange - backward_block))
    return comm, exposed
