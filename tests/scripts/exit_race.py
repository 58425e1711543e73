"""Forces the race behind a hang at exit: a gloo collective started inside backward is still in flight when the
script drops the last reference to its process group (a DDP model's reducer, after destroy_process_group()).

Rank 0's gloo thread finishes that collective, and frees it, while rank 0 holds the GIL and never offers it (a
switch interval of an hour, a busy wait); freeing it needs the GIL. Then rank 0 drops the group. Without
multigpu's worker keeping destroyed groups referenced, the group's destructor waits for that thread with the GIL
held: a deadlock, every time. (Under a plain `python`, torch happens to keep the group alive until the interpreter's
teardown, where the same race aborts the process instead.)

    multigpu run -n 2 tests/scripts/exit_race.py SCRATCH_DIR
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main(scratch: Path) -> None:
    dist.init_process_group("gloo")
    rank, go = dist.get_rank(), scratch / "go"

    class LateAllReduce(torch.autograd.Function):
        """An identity whose backward starts an all-reduce it does not wait for, as DDP's are started: rank 1
        starts its part only once rank 0 says "go"."""

        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            while rank == 1 and not go.exists():
                time.sleep(0.01)
            dist.all_reduce(torch.ones(1), async_op=True)  # its handle dropped: gloo's thread holds the last one
            return grad

    model = DistributedDataParallel(nn.Linear(4, 1))
    model(LateAllReduce.apply(torch.ones(2, 4, requires_grad=True))).sum().backward()
    reducer = model.reducer  # the group's last holder once the model is gone
    dist.destroy_process_group()
    del model
    if rank == 0:
        sys.setswitchinterval(3600)  # a thread waiting for the GIL never makes this one give it up
        go.write_text("go")
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # holds the GIL while rank 1 joins and gloo's thread finishes
            pass
    del reducer
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
