"""Strategies on one named DeviceMesh: the layout arithmetic, the refusals, and what each strategy builds and uses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

import multigpu as mg
from multigpu.config.layout import ParallelDims
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.parallel.mesh import build_mesh
from multigpu.strategies import build_strategy
from tests.dist import run_in_processes
from tests.reference import Case, TinyNet, train_engine, train_reference
from tests.strategies.test_equivalence import assert_matches


@pytest.mark.parametrize(
    ("dims", "names", "shape", "world", "data_parallel"),
    [
        (ParallelDims(), (), (), 1, 1),
        (ParallelDims(replicate=4), ("replicate",), (4,), 4, 4),
        (ParallelDims(shard=3, tp=2), ("shard", "tp"), (3, 2), 6, 3),
        # Fields in any order, mesh outermost first: pp, replicate, shard, cp, tp.
        (ParallelDims(tp=2, shard=4, replicate=2, pp=3), ("pp", "replicate", "shard", "tp"), (3, 2, 4, 2), 48, 8),
        (ParallelDims(cp=2, shard=2, tp=2), ("shard", "cp", "tp"), (2, 2, 2), 8, 2),
        # Experts spread over shard x cp ranks take no processes of their own.
        (ParallelDims(shard=4, ep=2), ("shard",), (4,), 4, 4),
    ],
)
def test_layout_is_the_used_dims_outermost_first(
    dims: ParallelDims, names: tuple, shape: tuple, world: int, data_parallel: int
) -> None:
    assert (dims.names, dims.shape, dims.world_size, dims.data_parallel_size) == (names, shape, world, data_parallel)
    dims.check(world)  # the product is the world size: accepted


def test_kept_dims_stay_at_degree_one_in_their_place() -> None:
    assert ParallelDims().in_mesh(keep=("replicate",)) == (("replicate", 1),)
    assert ParallelDims(tp=2).in_mesh(keep=("shard",)) == (("shard", 1), ("tp", 2))
    with pytest.raises(UsageError, match=r"Unknown mesh dimension\(s\) \['dp'\]; choose from pp, replicate"):
        ParallelDims().in_mesh(keep=("dp",))


@pytest.mark.parametrize(
    ("degrees", "shown"), [({"replicate": 0}, "0"), ({"shard": -2}, "-2"), ({"tp": 1.5}, "1.5"), ({"cp": 0}, "0")]
)
def test_degrees_below_one_are_refused(degrees: dict, shown: str) -> None:
    (name,) = degrees
    with pytest.raises(UsageError, match=rf"^The {name} degree must be a whole number of at least 1, not {shown}; "):
        ParallelDims(**degrees)
    with pytest.raises(UsageError, match=r"^ep_size 3 spreads experts over the 4 data-parallel processes \(shard 2 x "):
        ParallelDims(shard=2, cp=2, ep=3)
    with pytest.raises(
        UsageError, match=r"^ep_size 4 spreads experts over the 2 data-parallel processes \(replicate 2\)"
    ):
        ParallelDims(replicate=2, ep=4)


@pytest.mark.parametrize(("world", "launched"), [(4, "4 were"), (1, "1 was")])
def test_a_product_other_than_the_world_size_is_refused(world: int, launched: str) -> None:
    with pytest.raises(UsageError) as refusal:
        ParallelDims(replicate=2, shard=3).check(world)
    assert str(refusal.value) == (
        f"replicate 2 x shard 3 x cp 1 x tp 1 x pp 1 = 6 processes, but {launched} launched; launch 6 "
        f"(multigpu run -n 6) or choose degrees whose product is {world}."
    )


@pytest.mark.parametrize(
    ("initialized", "refusal"),
    [(False, "A DeviceMesh needs a process group, and none exists"), (True, "Every degree is 1, so the mesh")],
)
def test_build_refuses_without_a_group_or_a_dimension(
    monkeypatch: pytest.MonkeyPatch, initialized: bool, refusal: str
) -> None:
    # Stand-ins for a one-process group, so that this process never joins a real one.
    monkeypatch.setattr(dist, "is_initialized", lambda: initialized)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    with pytest.raises(UsageError, match=refusal):
        build_mesh(ParallelDims(), "cpu")


@pytest.mark.parametrize(
    ("name", "settings", "dims", "mesh_dims"),
    [
        ("ddp", {}, ParallelDims(replicate=4), ("replicate",)),
        ("zero1", {}, ParallelDims(replicate=4), ("replicate",)),
        ("zero2", {}, ParallelDims(shard=4), ("shard",)),
        ("zero3", {}, ParallelDims(shard=4), ("shard",)),
        ("hsdp", {"replicate": 2}, ParallelDims(replicate=2, shard=2), ("replicate", "shard")),
        ("zero3", {"tp_size": 2}, ParallelDims(shard=2, tp=2), ("shard",)),
        ("tp", {}, ParallelDims(tp=4), ("tp",)),
        ("pp", {}, ParallelDims(pp=4), ("pp",)),
        ("pp", {"pp_size": 2}, ParallelDims(pp=2, replicate=2), ("pp",)),
        ("zero2", {"pp_size": 2}, ParallelDims(pp=2, shard=2), ("pp", "shard")),
        ("deepspeed", {}, ParallelDims(shard=4), ()),  # DeepSpeed makes its own groups: no mesh
    ],
)
def test_each_strategy_is_built_on_the_layout_resolved_for_it(
    name: str, settings: dict, dims: ParallelDims, mesh_dims: tuple
) -> None:
    strategy = build_strategy(name, mg.EngineConfig(strategy=name, **settings), world=4)
    assert (strategy.layout, strategy.mesh_dims) == (dims, mesh_dims)


@pytest.mark.parametrize(
    ("settings", "nodes", "dims"),
    [
        ({}, 1, ParallelDims(shard=8)),
        ({}, 2, ParallelDims(replicate=2, shard=4)),  # hsdp: one replica per node
        ({"pp_size": 2}, 2, ParallelDims(pp=2, replicate=1, shard=4)),  # one per node of each pipeline stage
        ({"tp_size": 2}, 2, ParallelDims(replicate=2, shard=2, tp=2)),
        ({"replicate": 4}, 1, ParallelDims(replicate=4, shard=2)),
    ],
)
def test_hsdp_replicas_default_to_one_per_node(settings: dict, nodes: int, dims: ParallelDims) -> None:
    config = mg.EngineConfig(strategy="hsdp", **settings)
    assert build_strategy("hsdp", config, world=8, nodes=nodes).layout == dims


STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def mesh_report(names: list[str], case: Case) -> dict:
    """Runs in each worker: trains `case` under each strategy, then reports the mesh it built and who uses it."""
    env = DistEnv.from_environ()
    report = {}
    for name in names:
        strategy = build_strategy(name, mg.EngineConfig(strategy=name), env.world_size)
        # The Engine takes the configured object too; kept here to look at its mesh afterwards.
        outcome = train_engine(dataclasses.replace(case, strategy=strategy))
        mesh = strategy.mesh
        model = TinyNet()
        model, optimizer = mg.Engine(strategy=strategy).setup(model, torch.optim.AdamW(model.parameters()))
        if name in ("ddp", "zero1"):  # DDP takes the mesh's group (given a mesh, it would rewrite DTensors)
            wired = model.process_group is mesh.get_group()
            if name == "zero1":
                wired = wired and optimizer.process_group is mesh.get_group()
        else:
            # Equal, not identical: torch interns DTensor specs, so zero3's may hold zero2's equal mesh object.
            wired = all(p.device_mesh == mesh for p in model.parameters())
        report[name] = {
            "names": mesh.mesh_dim_names,
            "shape": tuple(mesh.shape),
            "built_once": strategy.mesh is mesh,  # a second setup reuses the mesh
            "wired": wired,
            # A mesh over every process is the default group itself: no communicator of its own.
            "default_group": mesh.get_group() is dist.group.WORLD,
            "groups": len(_world.pg_names),
            "outcome": outcome,
        }
    # A dimension kept at degree 1 beside one that spans the world: it slices, and the other stays the default group.
    mesh = build_mesh(ParallelDims(replicate=env.world_size), "cpu", keep=("replicate", "shard"))
    report["kept"] = {
        "names": mesh.mesh_dim_names,
        "shape": tuple(mesh.shape),
        "shard_size": mesh["shard"].size(),
        "replicate_is_default": mesh["replicate"].get_group() is dist.group.WORLD,
    }
    return report


CASE = Case(samples=16, epochs=2)
OWN_DIM = {"ddp": "replicate", "zero1": "replicate", "zero2": "shard", "zero3": "shard"}


@pytest.fixture(scope="module")
def two_processes() -> list[dict]:
    return run_in_processes("tests.parallel.test_mesh:mesh_report", 2, timeout=180, names=STRATEGIES, case=CASE)


@pytest.mark.parametrize("name", STRATEGIES)
def test_each_strategy_runs_on_its_named_mesh(two_processes: list[dict], name: str) -> None:
    want = train_reference(CASE, world_size=2)
    for rank, report in enumerate(two_processes):
        outcome = report[name].pop("outcome")
        assert report[name] == {
            "names": (OWN_DIM[name],),
            "shape": (2,),
            "built_once": True,
            "wired": True,
            "default_group": True,
            "groups": 1,  # the default group alone
        }, f"rank {rank}"
        # The same groups and collectives as before the mesh: one process's results within fp32 reordering.
        assert_matches(CASE, outcome, want)


def test_a_kept_dimension_of_degree_one_can_be_sliced(two_processes: list[dict]) -> None:
    for report in two_processes:
        assert report["kept"] == {
            "names": ("replicate", "shard"),
            "shape": (2, 1),
            "shard_size": 1,
            "replicate_is_default": True,
        }


def test_one_process_keeps_the_strategy_dimension() -> None:
    (report,) = run_in_processes(
        "tests.parallel.test_mesh:mesh_report", 1, timeout=120, names=("ddp", "zero3"), case=CASE
    )
    want = train_reference(CASE, world_size=1)
    for name in ("ddp", "zero3"):
        outcome = report[name].pop("outcome")
        assert report[name] == {
            "names": (OWN_DIM[name],),
            "shape": (1,),
            "built_once": True,
            "wired": True,
            "default_group": True,
            "groups": 1,
        }
        assert_matches(CASE, outcome, want)
    assert report["kept"]["shape"] == (1, 1)


def test_the_data_parallel_rank_skips_the_tensor_parallel_ranks_of_a_replica() -> None:
    """tp innermost, pp outermost: the tp ranks of one replica read one batch, each pipeline stage counts alike."""
    assert [ParallelDims(shard=2, tp=2).data_parallel_rank(rank) for rank in range(4)] == [0, 0, 1, 1]
    dims = ParallelDims(pp=2, replicate=2, shard=1, tp=2)
    assert [dims.data_parallel_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [ParallelDims(replicate=3).data_parallel_rank(rank) for rank in range(3)] == [0, 1, 2]
