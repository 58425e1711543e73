"""Shards filled from one rank: a model sharded while still on the meta device gets its values from the rank that
makes them (a plain build's initialisation, or a pretrained checkpoint read a tensor at a time), a unit at a time.
The rank that makes them holds its shards and one whole unit; every other rank, its shards and one slice."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from multigpu.transforms.modules import MetaValues, give_back_freed_memory, post_order, release


@dataclass(frozen=True)
class Route:
    """The groups a tensor travels through from global rank 0: rows scattered over the first replica's `shard`
    group, then each slice broadcast along its `replicas` group (hsdp); buffers go to every rank."""

    shard: ProcessGroup
    replicas: ProcessGroup | None
    device: torch.device

    @classmethod
    def of(cls, mesh: DeviceMesh, device: torch.device) -> Route:
        names = mesh.mesh_dim_names or ()
        replicas = mesh.get_group("replicate") if "replicate" in names else None
        return cls(mesh.get_group(names[-1]), replicas, device)  # "shard", or "shard_cp" with cp folded in

    @property
    def in_first_replica(self) -> bool:
        return self.replicas is None or dist.get_group_rank(self.replicas, dist.get_rank()) == 0


def fill_shards(
    model: nn.Module, values: MetaValues, unit_names: set[str], mesh: DeviceMesh, device: torch.device
) -> None:
    """Sends the values `values` makes on global rank 0 into `model`'s shards on `mesh` (sharded DTensor
    parameters, whole buffers), the tensors of each unit in `unit_names` (module names; "" is the root) as soon
    as that unit is made."""
    route = Route.of(mesh, device)
    groups = tensor_groups(model, unit_names)
    if values.built is None:
        for names in groups.values():
            for name in names:
                send(model, None, name, route)
            keep_pace(device)
            give_back_freed_memory()
    else:
        make(model, values, groups, route)
    # Only the making rank drew the initial values from its random stream; every rank goes on from where that
    # stream now stands, as every rank of a plain build would.
    stream = torch.get_rng_state().to(device)
    dist.broadcast(stream, src=0)
    torch.set_rng_state(stream.cpu())


def make(model: nn.Module, values: MetaValues, groups: dict[str, list[str]], route: Route) -> None:
    built = values.built
    assert built is not None
    name_of = {id(module): name for name, module in built.named_modules()}

    def made(module: nn.Module) -> None:
        unit = name_of.get(id(module))
        if unit not in groups:
            return
        for name in groups[unit]:
            send(model, built, name, route)
        keep_pace(route.device)
        if unit:  # the root's tensors are the last; the copy goes when setup ends
            release(module)
            give_back_freed_memory()  # see its doc: without it the freed units' pages stay with this process

    values.make(made)


def keep_pace(device: torch.device) -> None:
    """Waits until every rank has received the unit just sent. A transport that buffers what it sends (gloo over
    TCP) would otherwise let the making rank run units ahead of slow receivers, holding copies of all of them."""
    dist.all_reduce(torch.zeros(1, device=device))


def tensor_groups(model: nn.Module, unit_names: set[str]) -> dict[str, list[str]]:
    """For each unit, children first, the full names of the parameters and buffers it holds that no unit inside it
    holds; a tied parameter goes with the first unit that holds it."""
    taken: set[int] = set()
    groups: dict[str, list[str]] = {}
    for name, module in post_order(model):
        if name not in unit_names:
            continue
        prefix = f"{name}." if name else ""
        tensors = [*module.named_parameters(prefix=prefix.rstrip(".")), *module.named_buffers(prefix.rstrip("."))]
        groups[name] = [full for full, tensor in tensors if id(tensor) not in taken]
        taken.update(id(tensor) for _, tensor in tensors)
    return groups


def send(model: nn.Module, built: nn.Module | None, name: str, route: Route) -> None:
    """One tensor from global rank 0 (where `built` is not None) into every rank's `model`: a sharded parameter
    scattered by rows, anything else broadcast whole."""
    target = _tensor(model, name)
    source = None if built is None else _tensor(built, name)
    with torch.no_grad():
        if isinstance(target, DTensor):
            local = target.to_local()
            if route.in_first_replica:
                scatter_rows(target, source, route)
            if route.replicas is not None and local.numel():
                whole = local if local.device == route.device else local.to(route.device)
                dist.broadcast(whole, src=dist.get_global_rank(route.replicas, 0), group=route.replicas)
                local.copy_(whole)
            return
        whole = target.data if target.device == route.device else torch.empty_like(target, device=route.device)
        if source is not None:
            whole.copy_(source)
        dist.broadcast(whole, src=0)
        target.data.copy_(whole)


def scatter_rows(target: DTensor, source: torch.Tensor | None, route: Route) -> None:
    """Scatters `source`'s rows into `target`'s local shards over the shard group, laid out as fully_shard lays
    them: torch.chunk pieces along dim 0 (the last ones shorter or empty), padded here to one size."""
    if target.placements[-1] != Shard(0) or target.dim() == 0:
        raise NotImplementedError(f"filling a {target.placements} parameter of shape {tuple(target.shape)}")
    size = dist.get_world_size(route.shard)
    rows = -(-target.shape[0] // size)
    local = target.to_local()
    direct = local.shape[0] == rows and local.is_contiguous() and local.device == route.device
    shape = (rows, *target.shape[1:])
    received = local if direct else torch.empty(shape, dtype=target.dtype, device=route.device)
    pieces = None
    if source is not None:
        whole = source.detach().to(device=route.device, dtype=target.dtype)
        pieces = [_padded(whole[i * rows : (i + 1) * rows], rows) for i in range(size)]
    dist.scatter(received, pieces, src=dist.get_global_rank(route.shard, 0), group=route.shard)
    if not direct:
        local.copy_(received[: local.shape[0]])


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` as its module holds it (a sharded DTensor parameter stays one)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    return module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]


def _padded(piece: torch.Tensor, rows: int) -> torch.Tensor:
    if piece.shape[0] == rows:
        return piece.contiguous()
    padded = piece.new_zeros((rows, *piece.shape[1:]))
    padded[: piece.shape[0]] = piece
    return padded
