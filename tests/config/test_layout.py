"""The groups of a layout that would cross the nodes' boundaries, each said in a sentence."""

from __future__ import annotations

import pytest

from multigpu.config.layout import ParallelDims, node_crossings


@pytest.mark.parametrize(
    ("dims", "per_node", "crossing"),
    [
        (ParallelDims(replicate=2, shard=4), 4, []),  # hsdp: a replica per node
        (ParallelDims(replicate=2, shard=4), 2, ["shard"]),  # hsdp with replicate 2 on 4 nodes of 2: shards cross
        (ParallelDims(shard=4, tp=2), 2, []),  # zero3 x tp: tp inside a node, the shards span nodes by design
        (ParallelDims(shard=2, tp=4), 2, ["tp"]),
        (ParallelDims(replicate=2, cp=3), 4, ["cp"]),
        (ParallelDims(pp=2, shard=2), 2, []),  # pp may cross nodes
    ],
)
def test_groups_that_talk_every_layer_stay_inside_a_node(dims: ParallelDims, per_node: int, crossing: list) -> None:
    lines = node_crossings(dims, per_node)
    assert [line.split()[1] for line in lines] == crossing
    for line in lines:
        assert f"cross the node boundaries ({per_node} processes per node)" in line


def test_hsdp_whose_replicas_span_nodes_is_told_the_replicate_that_fits() -> None:
    (line,) = node_crossings(ParallelDims(replicate=2, shard=4), 2)
    assert line.endswith("set replicate to 4 (one replica per node)")
