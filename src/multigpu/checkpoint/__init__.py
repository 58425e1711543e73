"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP), loadable at any world size or strategy.

The package's face: callers write `from multigpu import checkpoint` and `checkpoint.save(...)`. Its modules, by job:
  files     what a checkpoint directory holds, which rank writes each part, reading a part as plain data only
  rng       each rank's random number generator states
  writing   written whole or not at all (`.<name>.partial`, synced, renamed), a disk's refusal as one sentence
  sharded   save and load through DCP, in the foreground or the background
  finding   the checkpoints of a directory, and whether one is whole or damaged
  export    a sharded checkpoint's model read whole in one process (`multigpu export`)
  run_lock  one run per save directory
A test that patches a name here reaches the callers that read it through this face (recipes/, engine/), not the
modules here, which call each other directly.
"""

from __future__ import annotations

from multigpu.checkpoint.export import full_model_state, model_metadata
from multigpu.checkpoint.files import COMMUNICATION, METADATA, OBJECTS, RNG
from multigpu.checkpoint.finding import (
    STEP_DIR,
    check_checkpoint,
    damage,
    damaged_path,
    list_checkpoints,
    newest_usable,
    prune,
)
from multigpu.checkpoint.rng import NUMPY_RNG_GLOBALS, rng_state, set_rng_state
from multigpu.checkpoint.sharded import Conversion, begin_save, load, save, save_async, saved_entry, split_state, wait
from multigpu.checkpoint.writing import (
    check_shared,
    check_writable,
    commit,
    last_committed,
    translate_write_error,
    write_failed,
)

__all__ = [
    "COMMUNICATION",
    "METADATA",
    "NUMPY_RNG_GLOBALS",
    "OBJECTS",
    "RNG",
    "STEP_DIR",
    "Conversion",
    "begin_save",
    "check_checkpoint",
    "check_shared",
    "check_writable",
    "commit",
    "damage",
    "damaged_path",
    "full_model_state",
    "last_committed",
    "list_checkpoints",
    "load",
    "model_metadata",
    "newest_usable",
    "prune",
    "rng_state",
    "save",
    "save_async",
    "saved_entry",
    "set_rng_state",
    "split_state",
    "translate_write_error",
    "wait",
    "write_failed",
]
