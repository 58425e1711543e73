"""Finding checkpoints in a directory and telling a whole one from a damaged one, before anything is loaded."""

from __future__ import annotations

import itertools
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from multigpu.checkpoint.files import METADATA, OBJECTS, RNG, load_data, this_rank
from multigpu.checkpoint.rng import NUMPY_RNG_GLOBALS
from multigpu.core.errors import UsageError

STEP_DIR = re.compile(r"^step-(\d+)$")


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
    for small in [path / OBJECTS, *sorted(path.glob(RNG.format(rank="*")))]:
        try:
            with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS):
                load_data(small)
        except UsageError:
            raise  # loadable, but refused: its own sentence says what to do
        except Exception as error:
            return f"its {small.name} cannot be read ({type(error).__name__})"
    return None


def damaged_path(path: Path) -> Path:
    """Where a damaged checkpoint is kept: `.<name>.damaged`, or `.<name>.damaged-2`, ... where a damaged copy of
    the same step is kept already (a step written again after its first copy was damaged, and damaged again)."""
    names = (f".{path.name}.damaged{'' if n == 1 else f'-{n}'}" for n in itertools.count(1))
    return next(target for name in names if not (target := path.with_name(name)).exists())


def move_aside(path: Path) -> Path:
    """Moves the damaged checkpoint `path` out of the list (damaged_path); refuses where it cannot: left in place,
    it would be picked again and counted among the checkpoints pruning keeps."""
    target = damaged_path(path)
    try:
        os.replace(path, target)
    except FileNotFoundError:
        pass  # another process moved it meanwhile
    except OSError as error:
        raise UsageError(
            f"The damaged checkpoint {path} could not be moved aside to {target.name} ({error.strerror}); move or "
            "remove it yourself, then run again."
        ) from None
    return target


def newest_usable(directory: Path, say: Callable[[str], None]) -> Path | None:
    """The newest complete checkpoint under `directory` that loads, or None if there is none at all.

    Damaged ones newer than it (a disk that filled, a copy cut short) are passed over, named through `say`, and
    moved aside (move_aside, by rank 0), so that later runs neither pick them nor prune good ones in their favour.
    When checkpoints exist but none is usable, refuses with one sentence and moves nothing.
    """
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(directory)):
        reason = damage(path) if path.is_dir() else "it vanished"  # another rank moved it aside meanwhile
        if reason is None:
            if skipped:
                kept = [move_aside(damaged) for damaged, _ in skipped] if this_rank() == 0 else []
                names = ", ".join(f"{p.name} ({why})" for p, why in skipped)
                where = ", ".join(target.name for target in kept) or ".<name>.damaged"
                say(f"resume: passed over damaged checkpoint(s) {names}, kept as {where}; using {path.name}")
            return path
        skipped.append((path, reason))
    if skipped:
        newest, why = skipped[0]
        raise UsageError(
            f"None of the {len(skipped)} checkpoint(s) in {directory} can be loaded ({newest.name}: {why}); move "
            "them aside to start over, restore a good copy, or choose another --save-dir."
        )
    return None


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints under `directory`, oldest first (partial ones are hidden and never listed)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [path for _, path in sorted(found)]


def prune(newest: Path, keep: int) -> None:
    """Removes the checkpoints beside `newest` (the one just committed) but the `keep` newest up to it. Those of
    later steps stay: a run resumed from an older checkpoint writes below them, and the newest good checkpoint must
    never make way for them (they may be damaged ones no run has looked at yet)."""
    found = list_checkpoints(newest.parent)
    up_to = found[: found.index(newest) + 1] if newest in found else []
    for old in up_to[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
