"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP), loadable at any world size or strategy.

A checkpoint is a directory:
  .metadata, __*_*.distcp   model and optimizer tensors, each rank writing its own shards (DCP)
  objects.pt                everything else in the state (schedulers, the loader's position, counters), rank 0
  rng-rank<R>.pt            each rank's random number generator states
It is written under `.<name>.partial` and renamed to `<name>` only when every part is synced to disk, so a crash or
a power loss during a save never leaves something that resume would pick up. Loading builds only tensors and plain
data (torch.load's weights_only), so a checkpoint from someone else cannot run code.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from multigpu import faults
from multigpu.errors import UsageError
from multigpu.strategies import Strategy

OBJECTS, METADATA = "objects.pt", ".metadata"
STEP_DIR = re.compile(r"^step-(\d+)$")


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _grouped() else 0


def _barrier() -> None:
    if _grouped():
        dist.barrier()


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def _replaced_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.replaced")


def _fsync(path: Path) -> None:
    """Forces `path` to disk: a file's bytes, or a directory's entries (the files created and renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_synced(obj: Any, file: Path) -> None:
    torch.save(obj, file)
    _fsync(file)


def _load_data(file: Path) -> Any:
    """torch.load restricted to tensors and plain data; a refused global becomes a sentence that says what to do."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as refusal:
        refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(file))
        if not refused:
            raise  # damaged rather than refused: torch's own message says more
        raise UsageError(
            f"{file} holds {', '.join(refused)}, which loading refuses to build because unpickling could run code; "
            "if you trust the file, allow-list the types with torch.serialization.add_safe_globals before loading."
        ) from refusal


def _owner(optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module], strategy: Strategy) -> nn.Module:
    """The module whose parameters `optimizer` updates (DCP keys optimizer states by parameter names)."""
    for module in modules.values():
        if strategy.updates(optimizer, module):
            return module
    raise UsageError("An optimizer in the checkpoint state updates no module in it; put its model in the state too.")


def split_state(
    state: dict[str, Any], strategy: Strategy, loading: bool = False
) -> tuple[dict[str, Any], dict[str, Any], list[Callable[[dict[str, Any]], None]]]:
    """Tensors for DCP (to write, or with `loading` to read into), everything else for objects.pt, and the calls
    that put loaded tensors back."""
    modules = {key: value for key, value in state.items() if isinstance(value, nn.Module)}
    tensors, objects, restore = {}, {}, []
    for key, value in state.items():
        if isinstance(value, nn.Module):
            tensors[key] = strategy.model_state_to_load(value) if loading else strategy.model_state_dict(value)
            restore.append(lambda loaded, key=key, value=value: strategy.load_model_state_dict(value, loaded[key]))
        elif isinstance(value, torch.optim.Optimizer):
            model = _owner(value, modules, strategy)
            if loading:
                tensors[key] = strategy.optimizer_state_to_load(model, value)
            else:
                tensors[key] = strategy.optimizer_state_dict(model, value)
            restore.append(
                lambda loaded, key=key, model=model, value=value: strategy.load_optimizer_state_dict(
                    model, value, loaded[key]
                )
            )
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            objects[key] = value.state_dict()
        else:
            objects[key] = value
    return tensors, objects, restore


# numpy's RNG state is a tuple holding a uint32 array; unpickling it takes these globals. The array's reconstructor
# moved from numpy.core to numpy._core in numpy 2 (an array's reduce names it in either); numpy 1's files use the old.
_reconstruct_array = np.empty(0).__reduce__()[0]
NUMPY_RNG_GLOBALS = [
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
    _reconstruct_array,
    (_reconstruct_array, "numpy.core.multiarray._reconstruct"),
]


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def begin_save(path: Path, state: dict[str, Any], strategy: Strategy) -> tuple[Path, dict[str, Any]]:
    """Prepares `.<name>.partial` with the small files; returns it and the tensors DCP must write there."""
    tmp = partial_path(path)
    tensors, objects, _ = split_state(state, strategy)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of a save that crashed
        tmp.mkdir(parents=True)
    _barrier()
    if _rank() == 0:
        _save_synced(objects, tmp / OBJECTS)
    _save_synced(rng_state(), tmp / f"rng-rank{_rank()}.pt")
    return tmp, tensors


def commit(path: Path) -> None:
    """Rank 0 only, once every rank's files are written and synced: the rename that makes the checkpoint exist.

    A checkpoint already at `path` is moved aside and removed only once the new one is in place, so a crash at any
    moment leaves a complete checkpoint on disk (between the two renames, the old one as `.<name>.replaced`).
    """
    tmp, replaced = partial_path(path), _replaced_path(path)
    _fsync(tmp)  # the names of its files; their bytes are synced by whoever wrote them (DCP: sync_files=True)
    if path.exists():
        shutil.rmtree(replaced, ignore_errors=True)  # left by a crash after an earlier commit of this name
        os.replace(path, replaced)
    os.replace(tmp, path)
    _fsync(path.parent)  # the rename itself must survive a power loss
    shutil.rmtree(replaced, ignore_errors=True)


def save(path: str | Path, state: dict[str, Any], strategy: Strategy) -> Path:
    path = Path(path)
    tmp, tensors = begin_save(path, state, strategy)
    dcp.save(tensors, checkpoint_id=tmp)
    _barrier()
    if _rank() == 0:
        faults.inject("save", step=state.get("step", -1), rank=0)
        commit(path)
    _barrier()
    return path


def check_checkpoint(path: Path) -> None:
    if not (path / METADATA).is_file() or not (path / OBJECTS).is_file():
        raise UsageError(
            f"{path} is not a multigpu checkpoint (it lacks {METADATA} or {OBJECTS}); pass a directory written "
            "by engine.save, e.g. <save-dir>/checkpoints/step-00000100."
        )


def _check_shapes(path: Path, tensors: dict[str, Any]) -> None:
    """Names the first parameter whose shape differs, instead of DCP's long error from deep inside the load."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, value in _flatten(tensors):
        if not isinstance(value, torch.Tensor):
            continue
        saved = metadata.get(key)
        if saved is None:
            raise UsageError(f"The checkpoint {path} has no {key}; it holds a different model or optimizer.")
        shape = tuple(value.shape)  # a DTensor reports its global shape
        if hasattr(saved, "size") and tuple(saved.size) != shape:
            raise UsageError(
                f"The checkpoint {path} holds a different model: {key} is {list(saved.size)} there and "
                f"{list(shape)} here; resume with the same model settings or start a new save directory."
            )


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [item for key, value in tree.items() for item in _flatten(value, f"{prefix}{key}.")]
    if isinstance(tree, list):
        return [item for index, value in enumerate(tree) for item in _flatten(value, f"{prefix}{index}.")]
    return [(prefix[:-1], tree)]


def load(path: str | Path, state: dict[str, Any], strategy: Strategy) -> None:
    """Restores `state` in place: modules and optimizers from DCP, stateful objects, plain values and RNG."""
    path = Path(path)
    check_checkpoint(path)
    tensors, _, restore = split_state(state, strategy, loading=True)
    _check_shapes(path, tensors)
    dcp.load(tensors, checkpoint_id=path)
    for put_back in restore:
        put_back(tensors)
    objects = _load_data(path / OBJECTS)
    for key, value in state.items():
        if isinstance(value, (nn.Module, torch.optim.Optimizer)):
            continue
        if key not in objects:
            raise UsageError(f"The checkpoint {path} has no {key!r}; it was saved with another state.")
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(objects[key])
        else:
            state[key] = objects[key]
    rng = path / f"rng-rank{_rank()}.pt"
    if rng.is_file():  # a rank that did not exist when the checkpoint was written keeps its seeded streams
        with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS):
            set_rng_state(_load_data(rng))


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints under `directory`, oldest first (partial ones are hidden and never listed)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [path for _, path in sorted(found)]


def prune(directory: Path, keep: int) -> None:
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def full_model_state(checkpoint: Path, key: str = "model") -> dict[str, torch.Tensor]:
    """One process reads the whole of `key` from a sharded checkpoint (the consolidation for export)."""
    check_checkpoint(checkpoint)
    metadata = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    prefix = f"{key}."
    wanted = {
        name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for name, meta in metadata.items()
        if name.startswith(prefix) and hasattr(meta, "size")
    }
    if not wanted:
        raise UsageError(f"The checkpoint {checkpoint} holds no {key!r} tensors; name the model's key in the state.")
    dcp.load(wanted, checkpoint_id=checkpoint, no_dist=True)
    return {name.removeprefix(prefix): tensor for name, tensor in wanted.items()}
