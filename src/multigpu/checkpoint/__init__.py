"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP), loadable at any world size or strategy.

A checkpoint is a directory:
  .metadata, __*_*.distcp   model and optimizer tensors, each rank writing its own shards (DCP)
  objects.pt                everything else in the state (schedulers, the loader's position, counters), rank 0
  rng-rank<R>.pt            each rank's random number generator states
  communication-rank<R>.pt  each rank's gradient compression state (ddp's PowerSGD), when it keeps one
It is written under `.<name>.partial` and renamed to `<name>` only when every part is synced to disk, so a crash or
a power loss during a save never leaves something that resume would pick up. Loading builds only tensors and plain
data (torch.load's weights_only), so a checkpoint from someone else cannot run code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from multigpu.core import faults
from multigpu.core.atomic import causes, disk_error, disk_errors_raised, partial_path, publish
from multigpu.core.errors import UsageError
from multigpu.core.launcher_notes import LAST_CHECKPOINT, note_for_launcher
from multigpu.core.lazy import instance_of

if TYPE_CHECKING:  # a type only: the launcher reads this module, and must not import every strategy
    from multigpu.strategies import Strategy

OBJECTS, METADATA = "objects.pt", ".metadata"
COMMUNICATION = "communication-rank{rank}.pt"
STEP_DIR = re.compile(r"^step-(\d+)$")


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _grouped() else 0


def _barrier() -> None:
    if _grouped():
        dist.barrier()


def _save_synced(obj: Any, file: Path) -> None:
    # Through a file object of ours: given a path, torch.save writes with C++ streams, whose failure says only
    # "basic_ios::clear: iostream error", without the OS's reason.
    with disk_errors_raised(), open(file, "wb") as stream:
        torch.save(obj, stream)
        stream.flush()
        os.fsync(stream.fileno())


@functools.cache
def _writer() -> type:
    """DCP's file writer (one file per rank, each synced to disk), whose failed writes raise their OSError. Made at
    the first save: importing DCP costs each process ~0.6 s of CPU, which a process that saves nothing (the CLI, the
    launcher reading its notes) need not pay."""
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Future:
            with disk_errors_raised():
                return super().write_data(plan, planner)

        def finish(self, metadata: Any, results: list) -> None:
            with disk_errors_raised():  # .metadata, written by rank 0 alone
                super().finish(metadata, results)

    return Writer


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
    """Prepares `.<name>.partial` with the small files; returns it and the tensors DCP must write there.

    Raises UsageError on every rank when any rank could not write (a full disk, a read-only directory): a rank that
    stopped alone would leave the others waiting in DCP's collectives until the timeout.
    """
    tmp = partial_path(path)
    tensors, objects, _ = split_state(state, strategy)
    failure = None
    try:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of a save that crashed
            tmp.mkdir(parents=True)
    except OSError as error:
        failure = error
    _agree(path, failure)
    try:
        faults.inject("write", step=state.get("step", -1), rank=_rank())
        if _rank() == 0:
            _save_synced(objects, tmp / OBJECTS)
        _save_synced(rng_state(), tmp / f"rng-rank{_rank()}.pt")
        # State a strategy keeps per rank beside the model and optimizer (ddp's PowerSGD error feedback).
        communication = strategy.communication_state()
        if communication is not None:
            _save_synced(communication, tmp / COMMUNICATION.format(rank=_rank()))
    except OSError as error:
        failure = error
    _agree(path, failure)
    return tmp, tensors


def _agree(path: Path, failure: OSError | None) -> None:
    """Raises the same write failure on every rank if any rank had one (a collective: every rank calls it)."""
    failures = [failure]
    if _grouped():
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    for rank, error in enumerate(failures):
        if error is not None:
            if _rank() == 0:
                shutil.rmtree(partial_path(path), ignore_errors=True)  # gives back what space it took
            raise write_failed(path, error, rank if _grouped() else None) from error


def write_failed(path: Path, error: OSError, rank: int | None = None) -> UsageError:
    """One sentence for a checkpoint the disk refused: what happened, that the last complete one is intact."""
    where = f" on rank {rank}" if rank is not None else ""
    done = list_checkpoints(path.parent)
    kept = [p for p in done if p != path] or done
    last = f"the last complete checkpoint, {kept[-1]}, is intact" if kept else "no complete checkpoint exists yet"
    refusal = UsageError(
        f"Could not write the checkpoint {path.name} in {path.parent}{where}: {error.strerror or error}; {last}. "
        "Free space or make the directory writable (or choose another save directory), then run the same command "
        "again to resume."
    )
    refusal.on_every_rank = _grouped()  # every rank raises it: DCP and _agree share each failure with all
    return refusal


def check_writable(directory: Path, flag: str, named: Path | None = None) -> None:
    """Refuses, before any training, a directory where nothing can be written (read-only, forbidden, a file).
    `named`: what the message calls `flag`'s value, where that is a file to be written in `directory`."""
    named = directory if named is None else named
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {named} cannot be created: {existing} is a file; choose another {flag}.")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".multigpu-write-test-"):
            pass
    except OSError as error:
        raise UsageError(
            f"{flag} {named} is not writable ({error.strerror} in {existing}); choose a directory you can write "
            "to, or fix its permissions."
        ) from None


_last_committed: Path | None = None  # by this process, for the line a stopped run ends with
_committing: Path | None = None  # the checkpoint whose commit is under way


def last_committed() -> Path | None:
    """The checkpoint this process committed last (rank 0, or a single process), or None. A commit that a stop
    interrupted right after its rename counts: the checkpoint is complete from the rename on, even if the stop came
    before the commit recorded it."""
    if _committing is not None and _committing.is_dir():
        return _committing.resolve()
    return _last_committed


def commit(path: Path) -> None:
    """Rank 0 only, once every rank's files are written and synced: the rename that makes the checkpoint exist
    (core/atomic.py's publish: a crash at any moment leaves a complete checkpoint on disk)."""
    global _committing, _last_committed
    _committing = path
    publish(path)
    _last_committed, _committing = path.resolve(), None
    note_for_launcher(LAST_CHECKPOINT, str(_last_committed))  # named when the run is stopped or fails


def save(path: str | Path, state: dict[str, Any], strategy: Strategy, keep_last: int | None = None) -> Path:
    """Writes `state` at `path` on every rank; once it is complete, keeps the newest `keep_last` siblings."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    tmp, tensors = begin_save(path, state, strategy)
    try:
        dcp.save(tensors, storage_writer=_writer()(tmp))
    except (Exception, CheckpointException) as error:
        raise translate_write_error(path, error) from error
    _barrier()
    if _rank() == 0:
        faults.inject("save", step=state.get("step", -1), rank=0)
        commit(path)
        if keep_last:
            prune(path.parent, keep_last)
    _barrier()
    return path


def save_async(path: Path, state: dict[str, Any], strategy: Strategy, keep_last: int | None) -> Future:
    """Starts writing `state` in the background; rank 0 commits, and keeps the newest `keep_last`, once every
    rank's shards are written. Wait on the future returned before exiting."""
    import torch.distributed.checkpoint as dcp

    global _background_group
    if _background_group is None and _grouped():
        # Background writes must not share a communicator with the training collectives running meanwhile.
        _background_group = dist.new_group(backend="gloo")
    tmp, tensors = begin_save(path, state, strategy)
    _barrier()  # every rank's small files are on disk before rank 0 may commit
    future = dcp.async_save(tensors, storage_writer=_writer()(tmp), process_group=_background_group)
    if _rank() != 0:
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
            prune(path.parent, keep_last)
    except BaseException as error:
        committed.set_exception(error)
    else:
        committed.set_result(None)


def translate_write_error(path: Path, error: BaseException) -> BaseException:
    """What to raise for a failed write of the checkpoint at `path`: a disk's refusal becomes one sentence (and the
    partial directory is removed, to give back the space); anything else stays as it was."""
    cause = disk_error(error)
    if cause is None:
        return error
    if _rank() == 0:
        shutil.rmtree(partial_path(path), ignore_errors=True)
    return write_failed(path, cause, _failed_rank(error) if _grouped() else None)


def _failed_rank(error: BaseException) -> int | None:
    """The first rank whose write DCP reports as refused by the disk, if DCP reported it."""
    for current in causes(error):
        if instance_of(current, "torch.distributed.checkpoint.api", "CheckpointException"):
            refused = [rank for rank, (failure, _) in current.failures.items() if disk_error(failure) is not None]
            if refused:
                return min(refused)
    return None


def check_checkpoint(path: Path) -> None:
    """Refuses, with one sentence, a path that is not a whole checkpoint."""
    if path.is_file():
        raise UsageError(
            f"{path} is a file, but a checkpoint is a directory; pass the directory engine.save wrote, e.g. "
            "<save-dir>/checkpoints/step-00000100."
        )
    if not path.exists():
        raise UsageError(
            f"{path} does not exist; pass a checkpoint directory, e.g. <save-dir>/checkpoints/step-00000100."
        )
    if not (path / METADATA).is_file() or not (path / OBJECTS).is_file():
        raise UsageError(
            f"{path} is not a multigpu checkpoint (it lacks {METADATA} or {OBJECTS}); pass a directory written "
            "by engine.save, e.g. <save-dir>/checkpoints/step-00000100."
        )
    reason = damage(path)
    if reason is not None:
        raise UsageError(f"The checkpoint {path} is damaged: {reason}; pass another checkpoint.")


def damage(path: Path) -> str | None:
    """What makes the checkpoint at `path` unloadable, in a few words, or None when every part of it is there and
    whole: its metadata and small files read back, and every shard file holds the bytes the metadata points to (a
    truncated or missing shard is caught here, not deep inside the load). Cheap: only the small files are read."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:  # unpickling a damaged file raises anything from EOFError to UnpicklingError
        return f"its {METADATA} cannot be read ({type(error).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"its shard {name} is missing"
        if shard.stat().st_size < size:
            return f"its shard {name} is truncated ({shard.stat().st_size} of {size} bytes)"
    for small in [path / OBJECTS, *sorted(path.glob("rng-rank*.pt"))]:
        try:
            with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS):
                _load_data(small)
        except UsageError:
            raise  # loadable, but refused: its own sentence says what to do
        except Exception as error:
            return f"its {small.name} cannot be read ({type(error).__name__})"
    return None


def damaged_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.damaged")


def newest_usable(directory: Path, say: Callable[[str], None]) -> Path | None:
    """The newest complete checkpoint under `directory` that loads, or None if there is none at all.

    Damaged ones newer than it (a disk that filled, a copy cut short) are passed over, named through `say`, and
    moved aside as `.<name>.damaged` (by rank 0), so that later runs neither pick them nor prune good ones in
    their favour. When checkpoints exist but none is usable, refuses with one sentence and moves nothing.
    """
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(directory)):
        reason = damage(path) if path.is_dir() else "it vanished"  # another rank moved it aside meanwhile
        if reason is None:
            if skipped:
                names = ", ".join(f"{p.name} ({why})" for p, why in skipped)
                say(f"resume: passed over damaged checkpoint(s) {names}, kept as .<name>.damaged; using {path.name}")
            for damaged, _ in skipped if _rank() == 0 else []:
                with contextlib.suppress(OSError):
                    os.replace(damaged, damaged_path(damaged))
            return path
        skipped.append((path, reason))
    if skipped:
        newest, why = skipped[0]
        raise UsageError(
            f"None of the {len(skipped)} checkpoint(s) in {directory} can be loaded ({newest.name}: {why}); move "
            "them aside to start over, restore a good copy, or choose another --save-dir."
        )
    return None


def _check_shapes(path: Path, tensors: dict[str, Any]) -> None:
    """Names the first parameter whose shape differs, instead of DCP's long error from deep inside the load."""
    import torch.distributed.checkpoint as dcp

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


def load(path: str | Path, state: dict[str, Any], strategy: Strategy, optional: tuple[str, ...] = ()) -> None:
    """Restores `state` in place: modules and optimizers from DCP, stateful objects, plain values and RNG.

    Keys in `optional` (non-tensor entries only) may be absent from the checkpoint: they keep what they hold."""
    import torch.distributed.checkpoint as dcp

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
        if key not in objects and key in optional:
            continue
        if key not in objects:
            raise UsageError(f"The checkpoint {path} has no {key!r}; it was saved with another state.")
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(objects[key])
        else:
            state[key] = objects[key]
    strategy.load_communication_state(functools.partial(_communication_state, path), _rank())
    rng = path / f"rng-rank{_rank()}.pt"
    if rng.is_file():  # a rank that did not exist when the checkpoint was written keeps its seeded streams
        with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS):
            set_rng_state(_load_data(rng))


def _communication_state(path: Path, rank: int) -> Any:
    """Rank `rank`'s saved communication state, or None where the checkpoint has none."""
    file = path / COMMUNICATION.format(rank=rank)
    return _load_data(file) if file.is_file() else None


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints under `directory`, oldest first (partial ones are hidden and never listed)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [path for _, path in sorted(found)]


def prune(directory: Path, keep: int) -> None:
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def model_metadata(checkpoint: Path, key: str = "model") -> dict[str, Any]:
    """`key`'s tensors in a checkpoint, by name within `key`: their metadata (`.size`, `.properties.dtype`),
    read without any tensor."""
    import torch.distributed.checkpoint as dcp

    check_checkpoint(checkpoint)
    metadata = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    prefix = f"{key}."
    found = {
        name.removeprefix(prefix): meta
        for name, meta in metadata.items()
        if name.startswith(prefix) and hasattr(meta, "size")
    }
    if not found:
        raise UsageError(f"The checkpoint {checkpoint} holds no {key!r} tensors; name the model's key in the state.")
    return found


def full_model_state(
    checkpoint: Path, key: str = "model", names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """One process reads the whole of `key` (or of its tensors `names`) from a sharded checkpoint (the
    consolidation for export)."""
    import torch.distributed.checkpoint as dcp

    stored = model_metadata(checkpoint, key)
    wanted = {
        f"{key}.{name}": torch.empty(tuple(stored[name].size), dtype=stored[name].properties.dtype)
        for name in (stored if names is None else names)
    }
    with warnings.catch_warnings():  # no_dist=True says so already
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(wanted, checkpoint_id=checkpoint, no_dist=True)
    return {name.removeprefix(f"{key}."): tensor for name, tensor in wanted.items()}
