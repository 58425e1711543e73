"""What every launcher gives its workers beyond torchrun's variables, so that accelerate, HF Trainer and Lightning
scripts cooperate unchanged: `multigpu run` (multigpu.launch.launcher) and `multigpu run --ray`
(multigpu.launch.ray_cluster) alike."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from multigpu.core.errors import UsageError


def use_cpu_for_accelerate(world: int) -> None:
    """Makes accelerate and HF Trainer scripts cooperate when the workers have no CUDA GPU.

    Measured with accelerate 1.15 and transformers 5.x on CPU: unless ACCELERATE_USE_CPU is true (or the script
    passes Accelerator(cpu=True) / TrainingArguments(use_cpu=True)), each worker joins a torch.distributed group
    of the full size yet reports num_processes 1, neither wraps the model in DDP nor splits the data, and trains
    alone on the whole dataset, without an error. Plain torch.distributed scripts ignore the variable.
    """
    value = os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    if value.strip().lower() in ("0", "false", "no", "n", "f", "off"):
        raise UsageError(
            f"ACCELERATE_USE_CPU={value} on a machine without CUDA GPUs makes accelerate and HF Trainer train each "
            f"of the {world} processes alone; unset it (multigpu run then sets it to true) or set it to true."
        )


@contextlib.contextmanager
def lightning_defaults(nproc: int, nnodes: int) -> Iterator[None]:
    """Within it, Lightning Trainer scripts cooperate: the processes per node and the nodes are the defaults of
    Trainer's devices and num_nodes, unless the user has set them; after it, the environment is as it was (bench
    launches runs of several sizes from one process).

    Measured with Lightning 2.6 on CPU: Trainer()'s default devices="auto" counts one CPU device, so each worker
    picks a single-device strategy, never joins a group and trains alone on the whole dataset, without an error.
    On GPUs "auto" counts every visible GPU, which is not the processes per node under `-n` or `--gpu-ids`, and
    num_nodes stays 1 on several nodes; either way the DistributedSampler splits the data into the wrong number
    of parts. The Trainer takes its defaults from PL_TRAINER_<ARGUMENT>; arguments the script passes win.
    """
    defaults = lightning_environment(nproc, nnodes)
    unset = list(defaults)
    os.environ.update(defaults)
    try:
        yield
    finally:
        for name in unset:
            os.environ.pop(name, None)


def lightning_environment(nproc: int, nnodes: int) -> dict[str, str]:
    """Lightning's Trainer defaults for `nproc` processes per node on `nnodes` nodes (see lightning_defaults): those
    the user has not set already."""
    defaults = {"PL_TRAINER_DEVICES": str(nproc), "PL_TRAINER_NUM_NODES": str(nnodes)}
    return {name: value for name, value in defaults.items() if name not in os.environ}
