"""A training loop written as users write theirs (its own step count, a validation pass at the end), run by the
fault-tolerance tests under `multigpu run --replica-groups N`: it prints, from each replica group's first rank, its
pid, a hash of the weights after every committed step, and the final validation loss.

    python replica_fit.py STRATEGY STEPS [SECONDS]

SECONDS: how long each step takes at least while a replica group is missing (the compute of a larger model), so
that the others are still training when it has started again; steps with every group take what they take.
"""

import hashlib
import os
import sys
import time

import torch
from torch import nn

import multigpu as mg

GLOBAL_BATCH = 24

strategy, steps, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
generator = torch.Generator().manual_seed(0)
x = torch.randn(960, 16, generator=generator)
y = torch.tanh(x @ torch.randn(16, 4, generator=generator)) + 0.1 * torch.randn(960, 4, generator=generator)
train, val = torch.utils.data.TensorDataset(x[:768], y[:768]), torch.utils.data.TensorDataset(x[768:], y[768:])

engine = mg.Engine(strategy=strategy)
group = os.environ.get("REPLICA_GROUP_ID", "-")
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
loader = engine.dataloader(train, batch_size=GLOBAL_BATCH // engine.data_parallel_size)
val_loader = engine.dataloader(val, batch_size=48, shuffle=False)
state = {"step": 0}
engine.heal_with(state)  # the step count a group that rejoins takes from a live one
first = engine.rank == 0  # each group's first rank (engine.is_main_process is group 0's alone)


def weights_hash() -> str:
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in whole)).hexdigest()[:16]


if first:
    print(f"pid group={group} pid={os.getpid()}", flush=True)
while state["step"] < steps:
    model.train()
    for inputs, targets in loader:
        engine.backward(nn.functional.mse_loss(model(inputs), targets))
        if engine.step(optimizer):
            state["step"] += 1
            digest = weights_hash()  # every rank: the full tensors are gathered collectively under FSDP
            if first:
                print(f"hash group={group} step={state['step']} weights={digest} at={time.monotonic():.3f}", flush=True)
            quorum = engine.replica_quorum
            if quorum is not None and quorum["replicas"] < quorum["replica_groups"]:
                time.sleep(step_s)
            if state["step"] >= steps:
                break
model.eval()
total = count = 0.0
with torch.no_grad():
    for inputs, targets in val_loader:
        real = val_loader.yielded[-1].real
        total += float(nn.functional.mse_loss(model(inputs)[:real], targets[:real], reduction="sum"))
        count += real * targets.shape[1]
loss = engine.reduce(total, "sum") / engine.reduce(count, "sum")
if first:
    print(f"val group={group} loss={loss:.9f} quorum={engine.replica_quorum}", flush=True)
