"""The DeviceMesh of a layout (config/layout.py's ParallelDims): one dimension per degree in use, named, outermost
first. ddp and zero1 replicate the model over every process, zero2/zero3 shard it, hsdp (replicate x shard) and 2-D
parallelism (shard x tp) are layouts of the same named dimensions, so a strategy names the dimensions it works on
(`mesh_dims`) and takes them from one mesh."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from multigpu.config.layout import ParallelDims
from multigpu.core.errors import UsageError


def build_mesh(dims: ParallelDims, device_type: str, keep: Sequence[str] = ()) -> DeviceMesh:
    """The DeviceMesh of `dims` over the default process group, its dimensions named as `dims.in_mesh(keep)`.

    A dimension that spans every process reuses the default group (torch creates no communicator for it); any other
    dimension costs torch one new group per process, degree-1 dimensions in `keep` included.
    """
    if not dist.is_initialized():
        raise UsageError(
            "A DeviceMesh needs a process group, and none exists; create the Engine (which joins one) or call "
            "torch.distributed.init_process_group before building the mesh."
        )
    dims.check(dist.get_world_size())
    named = dims.in_mesh(keep)
    if not named:
        raise UsageError(
            "Every degree is 1, so the mesh would have no dimension; name the dimension to keep, e.g. "
            "keep=('replicate',)."
        )
    shape, names = tuple(degree for _, degree in named), tuple(name for name, _ in named)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def with_cp(mesh: DeviceMesh, dims: Sequence[str]) -> DeviceMesh:
    """`mesh` over `dims` (those it has), with its cp dimension folded into the last of them. The cp ranks of a
    replica hold the same parameters and each computes the gradient of its own slice of the sequences, so their
    gradients are reduced, and their parameters sharded, together with those of `dims` (torchtitan folds cp into
    its data-parallel shards the same way)."""
    names = mesh.mesh_dim_names or ()
    dims = tuple(dim for dim in dims if dim in names)
    if "cp" not in names:
        return mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    if not dims:
        return mesh["cp"]
    *outer, last = dims
    folded = mesh[last, "cp"]._flatten(f"{last}_cp")  # made once; later calls return the same mesh
    if not outer:
        return folded
    # hsdp's (replicate, shard x cp): torch slices a flattened dimension from the root mesh and warns that it will
    # ask callers to keep such meshes themselves, which it offers no other way to combine with another dimension.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
        return mesh[(*outer, folded.mesh_dim_names[0])]
