"""Saving and loading a state with torch.distributed.checkpoint (DCP): each rank writes and reads its own shards of
the models and optimizers, so a checkpoint loads at any world size or strategy; the rest of the state goes beside
them (checkpoint/files.py says where)."""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from multigpu.checkpoint.files import COMMUNICATION, OBJECTS, RNG, barrier, grouped, load_data, save_synced, this_rank
from multigpu.checkpoint.finding import check_checkpoint, prune
from multigpu.checkpoint.rng import NUMPY_RNG_GLOBALS, rng_state, set_rng_state
from multigpu.checkpoint.writing import agree_on_failure, check_shared, commit, synced_writer, translate_write_error
from multigpu.core import faults
from multigpu.core.atomic import partial_path
from multigpu.core.errors import UsageError

if TYPE_CHECKING:  # a type only: the launcher reads this package, and must not import every strategy
    from multigpu.strategies import Strategy


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


def begin_save(path: Path, state: dict[str, Any], strategy: Strategy) -> tuple[Path, dict[str, Any]]:
    """Prepares `.<name>.partial` with the small files; returns it and the tensors DCP must write there.

    Raises UsageError on every rank when any rank could not write (a full disk, a read-only directory): a rank that
    stopped alone would leave the others waiting in DCP's collectives until the timeout.
    """
    check_shared(path.parent)
    tmp = partial_path(path)
    tensors, objects, _ = split_state(state, strategy)
    failure = None
    try:
        if this_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of a save that crashed
            tmp.mkdir(parents=True)
    except OSError as error:
        failure = error
    agree_on_failure(path, failure)
    try:
        faults.inject("write", step=state.get("step", -1), rank=this_rank())
        if this_rank() == 0:
            save_synced(objects, tmp / OBJECTS)
        save_synced(rng_state(), tmp / RNG.format(rank=this_rank()))
        # State a strategy keeps per rank beside the model and optimizer (ddp's PowerSGD error feedback).
        communication = strategy.communication_state()
        if communication is not None:
            save_synced(communication, tmp / COMMUNICATION.format(rank=this_rank()))
    except OSError as error:
        failure = error
    agree_on_failure(path, failure)
    return tmp, tensors


def save(path: str | Path, state: dict[str, Any], strategy: Strategy, keep_last: int | None = None) -> Path:
    """Writes `state` at `path` on every rank; once it is complete, keeps the newest `keep_last` siblings."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    tmp, tensors = begin_save(path, state, strategy)
    try:
        dcp.save(tensors, storage_writer=synced_writer()(tmp))
    except (Exception, CheckpointException) as error:
        raise translate_write_error(path, error) from error
    barrier()
    if this_rank() == 0:
        faults.inject("save", step=state.get("step", -1), rank=0)
        commit(path)
        if keep_last:
            prune(path, keep_last)
    barrier()
    return path


def save_async(path: Path, state: dict[str, Any], strategy: Strategy, keep_last: int | None) -> Future:
    """Starts writing `state` in the background; rank 0 commits, and keeps the newest `keep_last`, once every
    rank's shards are written. Wait on the future returned before exiting."""
    import torch.distributed.checkpoint as dcp

    global _background_group
    if _background_group is None and grouped():
        # Background writes must not share a communicator with the training collectives running meanwhile.
        _background_group = dist.new_group(backend="gloo")
    tmp, tensors = begin_save(path, state, strategy)
    barrier()  # every rank's small files are on disk before rank 0 may commit
    future = dcp.async_save(tensors, storage_writer=synced_writer()(tmp), process_group=_background_group)
    if this_rank() != 0:
        return future
    # Rank 0's future completes after the metadata, i.e. after every rank's shards are written; the future it
    # returns completes once the checkpoint is committed, so that wait() raises a failed commit too.
    committed: Future = Future()
    future.add_done_callback(lambda written: _commit_when_written(written, committed, path, keep_last))
    return committed


_background_group: dist.ProcessGroup | None = None


def wait(pending: Future, path: Path) -> None:
    """Waits for a background save of `path` to finish; a failed write raises as `save` would have raised."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        pending.result()
    except (Exception, CheckpointException) as error:
        raise translate_write_error(path, error) from error


def _commit_when_written(written: Future, committed: Future, path: Path, keep_last: int | None) -> None:
    # Nothing may raise out of here: concurrent.futures would only log it, with a traceback, and lose it.
    try:
        written.result()  # a failed write raises here, and never becomes a checkpoint
        commit(path)
        if keep_last:
            prune(path, keep_last)
    except BaseException as error:
        committed.set_exception(error)
    else:
        committed.set_result(None)


def _check_shapes(path: Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Names the first parameter whose shape differs, instead of DCP's long error from deep inside the load."""
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


class Conversion(Protocol):
    """Turns what a checkpoint holds under one key of the state into what the state's optimizer there loads (a
    state of another kind: optimizers/convert.py)."""

    def prepare(self, to_load: dict[str, Any], saved_dtype: Callable[[str], torch.dtype | None]) -> None:
        """Before DCP reads: `to_load` is what it reads into; `saved_dtype(key)` the dtype of its entry `key` (as
        DCP flattens it: "state.<parameter>.<name>") in the checkpoint."""

    def apply(self, loaded: dict[str, Any]) -> str:
        """After DCP read `loaded`, before the optimizer loads it; returns the line that says what it did."""


def load(
    path: str | Path,
    state: dict[str, Any],
    strategy: Strategy,
    optional: tuple[str, ...] = (),
    conversions: dict[str, Conversion] | None = None,
) -> list[str]:
    """Restores `state` in place: modules and optimizers from DCP, stateful objects, plain values and RNG.

    Keys in `optional` (non-tensor entries only) may be absent from the checkpoint: they keep what they hold. An
    optimizer under a key of `conversions` loads what that conversion makes of the checkpoint's; their lines are
    returned. A param group setting the checkpoint does not hold keeps the optimizer's own (_own_group_settings)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    check_checkpoint(path)
    tensors, _, restore = split_state(state, strategy, loading=True)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    conversions = conversions or {}
    for key, conversion in conversions.items():
        conversion.prepare(tensors[key], functools.partial(_saved_dtype, metadata, key))
    _check_shapes(path, tensors, metadata)
    with _own_group_settings(tensors, metadata):
        dcp.load(tensors, checkpoint_id=path)
    lines = [conversion.apply(tensors[key]) for key, conversion in conversions.items()]
    for put_back in restore:
        put_back(tensors)
    objects = load_data(path / OBJECTS)
    for key, value in state.items():
        if isinstance(value, (nn.Module, torch.optim.Optimizer)):
            continue
        if key not in objects and key in optional:
            continue
        if key not in objects:
            raise UsageError(f"The checkpoint {path} has no {key!r}; it was saved with another state.")
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(objects[key])
        else:
            state[key] = objects[key]
    strategy.load_communication_state(functools.partial(_communication_state, path), this_rank())
    rng = path / RNG.format(rank=this_rank())
    if rng.is_file():  # a rank that did not exist when the checkpoint was written keeps its seeded streams
        with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS):
            set_rng_state(load_data(rng))
    return lines


def saved_entry(path: str | Path, key: str) -> Any:
    """The checkpoint's plain (non-tensor) entry `key`, read without loading anything else; None where it has none
    (or `path` is no checkpoint, or a damaged one: load then says which)."""
    try:
        return load_data(Path(path) / OBJECTS).get(key)
    except Exception:  # unpickling a damaged file raises anything: check_checkpoint, in load, names it
        return None


def _saved_dtype(metadata: dict[str, Any], key: str, entry: str) -> torch.dtype | None:
    """The dtype the checkpoint holds tensor `entry` of the state's `key` in (None: no such tensor)."""
    saved = metadata.get(f"{key}.{entry}")
    return saved.properties.dtype if hasattr(saved, "properties") else None


@contextlib.contextmanager
def _own_group_settings(tensors: dict[str, Any], metadata: dict[str, Any]) -> Iterator[None]:
    """Around DCP's load: the settings of an optimizer's param groups that the checkpoint does not hold (another
    kind of optimizer wrote it: torch's AdamW has `maximize`, torchao's has not) keep the optimizer's own values,
    where DCP would refuse the whole load for want of them."""
    absent = []
    for key, value in tensors.items():
        for index, group in enumerate(value.get("param_groups", []) if isinstance(value, dict) else []):
            for name in [name for name in group if f"{key}.param_groups.{index}.{name}" not in metadata]:
                absent.append((group, name, group.pop(name)))
    try:
        yield
    finally:
        for group, name, own in absent:
            group[name] = own


def _communication_state(path: Path, rank: int) -> Any:
    """Rank `rank`'s saved communication state, or None where the checkpoint has none."""
    file = path / COMMUNICATION.format(rank=rank)
    return load_data(file) if file.is_file() else None
