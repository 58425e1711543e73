"""DDP's gradient compression hooks (compression.py), and PowerSGD's state keyed by parameter names.

torch's PowerSGD hook keeps its state per DDP bucket: the error feedback as one flat tensor per bucket, the
warm-started factors P and Q as one flat tensor each, all laid out in the bucket's order. Which parameters a bucket
holds changes: DDP regroups its buckets after the first step, and a resumed run starts from the first grouping
again. The hook here keeps, for each bucket, the names of the parameters its state was laid out for; when a bucket
comes with other parameters, every bucket's state is cut into per-parameter pieces and laid out anew. So a
checkpoint holds per-parameter tensors, whatever grouping wrote them, and a resume feeds each parameter its own.
"""

# No `from __future__ import annotations`: DDP compares a hook's annotations with dist.GradBucket and
# torch.futures.Future[torch.Tensor] themselves, and refuses the strings that import would make of them.
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from multigpu.core.errors import UsageError
from multigpu.parallel.compression import POWERSGD_START, Compression, compressed

#: The state file's format; a checkpoint of another format is refused rather than misread.
FORMAT = 1
#: Added to each column's norm before dividing: a matrix whose gradient is all zeros in a step (a parameter unused
#: that step, under find_unused_parameters) would otherwise make its factors NaN.
ORTHOGONALIZATION_EPSILON = 1e-8


def bf16_reduce(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16 hook under another name: DDP refuses the hook by its name unless built with CUDA and NCCL, but
    gloo reduces bf16 tensors as well (measured: torch 2.13, CPU)."""
    return default_hooks.bf16_compress_hook(group, bucket)


def fp16_reduce(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return default_hooks.fp16_compress_hook(group, bucket)


class KeyedPowerSGD:
    """torch's PowerSGDState, with its per-bucket tensors re-laid out whenever a bucket's parameters change, and
    saved and loaded per parameter."""

    def __init__(self, model: DistributedDataParallel, group: dist.ProcessGroup, rank: int) -> None:
        self.state = PowerSGDState(
            process_group=group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=POWERSGD_START,
            orthogonalization_epsilon=ORTHOGONALIZATION_EPSILON,
            use_error_feedback=True,
            warm_start=True,
        )
        self.group, self.matrix_rank = group, rank
        self.names = {id(p): name for name, p in model.module.named_parameters()}
        self.shapes = {name: tuple(p.shape) for name, p in model.module.named_parameters()}
        #: Bucket index -> the parameters its state tensors are laid out for.
        self.layouts: dict[int, tuple[str, ...]] = {}
        #: Per-parameter state not laid out in a bucket yet: {name: {"error" | "p" | "q": tensor}}.
        self.loose: dict[str, dict[str, torch.Tensor]] = {}

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        names = tuple(self.names[id(p)] for p in bucket.parameters())
        index = bucket.index()
        if self.layouts.get(index) != names:
            self._unpack_all()
            self._pack(index, names, bucket.buffer())
            self.layouts[index] = names
        return powerSGD_hook(self.state, bucket)

    def _matrices(self, names: tuple[str, ...]) -> list[tuple[str, int, int]]:
        """(name, rows, rank) of the gradients the hook compresses, in the order it lays out their factors: grouped
        by matrix shape, the shapes in the order they first appear, the bucket's order within a shape."""
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name in names:
            shape = self.shapes[name]
            if compressed(shape, self.matrix_rank) is not None:
                n, m = shape[0], math.prod(shape) // shape[0]
                groups.setdefault((n, m), []).append((name, n, min(n, m, self.matrix_rank)))
        return [matrix for group in groups.values() for matrix in group]

    def _unpack_all(self) -> None:
        """Every bucket's state cut into per-parameter pieces (in `loose`); the buckets left without state."""
        self.loose = self.per_parameter()
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self.layouts.clear()

    def per_parameter(self) -> dict[str, dict[str, torch.Tensor]]:
        """{name: {"error", "p", "q": tensor}}: what every bucket holds, and what is not laid out in one yet."""
        pieces = {name: dict(parts) for name, parts in self.loose.items()}
        for index, names in self.layouts.items():
            error = self.state.error_dict.get(index)
            if error is not None:
                sizes = [math.prod(self.shapes[name]) for name in names]
                for name, piece in zip(names, error.split(sizes), strict=True):
                    pieces.setdefault(name, {})["error"] = piece.clone()
            matrices = self._matrices(names)
            for key, memory in (("p", self.state.p_memory_dict), ("q", self.state.q_memory_dict)):
                if index in memory:
                    sizes = [(n if key == "p" else math.prod(self.shapes[name]) // n) * r for name, n, r in matrices]
                    for (name, _, _), piece in zip(matrices, memory[index].split(sizes), strict=True):
                        pieces.setdefault(name, {})[key] = piece.clone()
        return pieces

    def _pack(self, index: int, names: tuple[str, ...], buffer: torch.Tensor) -> None:
        """Lays out the loose state of `names` as bucket `index`'s (nothing where they have none)."""
        held = [self.loose.get(name, {}) for name in names]
        if any("error" in parts for parts in held):
            self.state.error_dict[index] = torch.cat(
                [
                    parts["error"].to(buffer) if "error" in parts else buffer.new_zeros(math.prod(self.shapes[name]))
                    for name, parts in zip(names, held, strict=True)
                ]
            )
        matrices = self._matrices(names)
        if matrices and all({"p", "q"} <= self.loose.get(name, {}).keys() for name, _, _ in matrices):
            for key, memory in (("p", self.state.p_memory_dict), ("q", self.state.q_memory_dict)):
                memory[index] = torch.cat([self.loose[name][key].to(buffer) for name, _, _ in matrices])
        for name in names:
            self.loose.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: plain tensors and numbers (a checkpoint loads with weights_only)."""
        _, keys, position, has_gauss, gauss = self.state.rng.get_state()
        return {
            "format": FORMAT,
            "world_size": self.group.size(),
            "rank": self.matrix_rank,
            "iter": self.state.iter,
            "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": position, "gauss": [has_gauss, gauss]},
            "parameters": {
                name: {key: tensor.cpu() for key, tensor in parts.items()}
                for name, parts in self.per_parameter().items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.iter = state["iter"]
        rng = state["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        self.state.rng.set_state(("MT19937", keys, rng["position"], *rng["gauss"]))
        self._unpack_all()
        self.loose = {name: dict(parts) for name, parts in state["parameters"].items()}


def powersgd_hook(keeper: KeyedPowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's hook signature (state, bucket) for KeyedPowerSGD.hook."""
    return keeper.hook(bucket)


def register(model: DistributedDataParallel, compression: Compression, group: dist.ProcessGroup) -> Any:
    """Registers `compression`'s hook on `model`; returns PowerSGD's keeper (None for the others)."""
    if compression.kind == "powersgd":
        keeper = KeyedPowerSGD(model, group, compression.rank)
        model.register_comm_hook(keeper, powersgd_hook)
        return keeper
    hooks: dict[str, Callable] = {"bf16": bf16_reduce, "fp16": fp16_reduce}
    if compression.kind in hooks:
        model.register_comm_hook(group, hooks[compression.kind])
    return None


def load_keeper_state(keeper: KeyedPowerSGD | None, read: Callable[[int], Any], rank: int) -> None:
    """Puts back the PowerSGD state a checkpoint holds for this rank. `read(r)` is rank r's saved state (None:
    none saved). A checkpoint without any starts PowerSGD afresh (warm-up first); one written by another number of
    processes or at another rank is refused, on every rank alike, as each reads rank 0's record."""
    first = read(0)
    if keeper is None or first is None:
        return
    world, saved_rank = first.get("world_size"), first.get("rank")
    if first.get("format") != FORMAT or world != keeper.group.size():
        raise UsageError(
            f"This checkpoint holds PowerSGD's error feedback of {world} processes, one per process, and this run has "
            f"{keeper.group.size()}; resume it on {world} processes, or with another grad_compression (dropping it)."
        )
    if saved_rank != keeper.matrix_rank:
        raise UsageError(
            f"This checkpoint holds PowerSGD factors of rank {saved_rank}; resume with grad_compression "
            f"powersgd:{saved_rank}, or with another grad_compression (dropping them)."
        )
    keeper.load_state_dict(first if rank == 0 else read(rank))
