"""What expert parallelism costs in one training step (simulate.py's layout_step adds it): the all-to-alls that
send each token to its experts' ranks and back, and the data-parallel traffic of the experts, which only the ranks
holding the same slice of them share. Pure arithmetic."""

from __future__ import annotations

from multigpu.planner.links import Links, all_to_all, shared_link, span_link
from multigpu.planner.simulate_config import SimulateConfig
from multigpu.transforms.recompute import FORWARD_RUN_AGAIN


def ep_comm(config: SimulateConfig, intra: Links, inter: Links) -> tuple[float, float]:
    """(comm, exposed) seconds of ep's all-to-alls in one step of one GPU.

    Per mixture layer and micro-batch: dispatch (tokens to their experts' ranks) and combine (the experts' outputs
    back) in forward, their gradients in backward, and the forward's two again where full checkpointing runs it
    again. Each moves the rank's tokens x top-k x hidden activations, (ep - 1) / ep of them to other ranks
    (links.all_to_all, as cp's Ulysses all-to-alls are costed), routing taken as balanced. Nothing hides them: the
    experts wait for their tokens, the next layer for the combined output. An ep group is ep consecutive ranks of
    the data-parallel x cp processes, each tp ranks apart, so it spans ep x tp GPUs: inside a node while that fits,
    else every GPU of a node sends at once through the node's NICs, a 1/gpus_per_node share each."""
    ep = config.ep_size
    if ep == 1:
        return 0.0, 0.0
    m, layers = config.microbatches or 1, config.moe_layers / config.pp_size
    tokens = config.units_per_step * config.tokens_per_unit / (config.cp_size * m)  # one micro-batch's, this rank's
    size = tokens * config.experts_per_token * config.hidden * config.activation_bytes
    gpn = config.gpus_per_node
    link = span_link(ep * config.tp_size, gpn, intra["all_gather"], shared_link(inter["all_gather"], gpn))
    passes = 2 * (2 + FORWARD_RUN_AGAIN[config.activation_checkpointing])  # dispatch and combine, each pass
    comm = passes * layers * m * all_to_all(ep, size, link)
    return comm, comm


def parameter_groups(config: SimulateConfig, reducing: int) -> list[tuple[float, int]]:
    """(parameters of one GPU, ranks that reduce their gradients together) for its data-parallel traffic: the
    weights outside the experts (tp x pp's slice) over every data-parallel x cp rank, and under ep the rank's slice
    of the experts (1/pp of them, 1/ep of that; tp does not split experts) over the reducing ranks that hold the
    same slice, reducing / ep of them."""
    dense = config.params / config.model_parallel
    if config.ep_size == 1 or not config.expert_params:
        return [(dense, reducing)]
    experts = config.expert_params / (config.pp_size * config.ep_size)
    dense -= config.expert_params / config.model_parallel
    return [(dense, reducing), (experts, reducing // config.ep_size)]
