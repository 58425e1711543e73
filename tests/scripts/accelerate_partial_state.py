"""An accelerate script that builds only a PartialState (no Accelerator), as data-preparation scripts do.

    multigpu run -n 2 accelerate_partial_state.py OUTDIR

Each process writes OUTDIR/rank{RANK}.json: the number of processes and the index accelerate reported, and the
sum of every process's index + 1 gathered through accelerate.
"""

import json
import os
import sys

import torch
from accelerate import PartialState
from accelerate.utils import reduce


def main() -> None:
    state = PartialState()
    total = reduce(torch.tensor([state.process_index + 1.0], device=state.device), reduction="sum")
    record = {"world_size": state.num_processes, "rank": state.process_index, "sum": total.item()}
    # Named by the launcher's RANK: if accelerate ran each process alone, both would call themselves rank 0.
    with open(os.path.join(sys.argv[1], f"rank{os.environ.get('RANK', '0')}.json"), "w") as file:
        json.dump(record, file)
    state.destroy_process_group()


if __name__ == "__main__":
    main()
