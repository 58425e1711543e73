"""The `multigpu` command (and `python -m multigpu`): the CLI, its OpenMP threads set to sleep when idle."""

import os
import sys


def main() -> int:
    # A run in this process (`multigpu train` or `finetune` without --nproc) computes with one OpenMP thread per
    # core. OpenMP's default keeps an idle thread spinning, and on a busy machine the spinning threads take the cores
    # the work needs. Measured on 2 cores (torch 2.13, docs/benchmarks.md): the sensor trainer at 33 samples/s with
    # two busy processes beside it (1,937 idle), 664 with the threads sleeping (1,218 idle), 702 with one thread
    # (1,233 idle); SmolLM2 LoRA 101 s (38 s idle) against 63 s (44 s idle) and 87 s (54 s idle). Sleeping threads
    # are never far from the best, so they are the default unless the user chose. OpenMP reads it once, when torch
    # loads it: before the CLI's imports.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from multigpu.cli import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(main())
