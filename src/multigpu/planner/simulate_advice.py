"""What `multigpu simulate` advises where communication across nodes holds up the step: the changes (gradients
compressed, hsdp) whose predicted step, by the same arithmetic, is markedly shorter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from multigpu.core.errors import UsageError
from multigpu.parallel.compression import Compression
from multigpu.planner.rows import hybrid
from multigpu.planner.simulate import Prediction

#: A change is advised where it shortens the predicted step by at least this fraction of it (1.33x faster). Set by
#: two nodes on shaped links (docs/benchmarks.md): every change predicted to gain 1.4x or more was measured faster,
#: and neither of those predicted below 1.25x was: PowerSGD on an unshaped link (predicted 1.18-1.21x, measured
#: 0.99x: its factorisations cost what they save) and hsdp at 1 Gbit/s (1.19-1.22x, measured 0.97x).
ADVICE_GAIN = 0.25


def link_advice(request: Any, predictions: list[Prediction], predict: Callable[[Any], Prediction]) -> str | None:
    """Where communication holds up the step across nodes: the changes that shorten the predicted step of the
    largest run that spans nodes by ADVICE_GAIN or more (gradients in bf16, PowerSGD's factors, hsdp's shards inside
    a node and one all-reduce of a shard across), each predicted by the same arithmetic, fastest first. None where
    no run spans nodes or no change gains that much (a fast link, or compute that hides the collectives).
    `request`: simulate_request's SimulateRequest (typed Any: that module imports this one); `predict`: the one
    prediction of a request (simulate_request: resolved and simulated)."""
    across = [p for p in predictions if p.nodes > 1]
    if not across or across[-1].exposed_comm_s <= 0:
        return None
    now = across[-1]
    changes: list[tuple[str, dict[str, str]]] = []
    if Compression.parse(request.grad_compression).kind == "none":
        changes += [(f"--grad-compression {kind}", {"grad_compression": kind}) for kind in ("bf16", "powersgd")]
    if (name := hybrid()) is not None and request.strategy != name and request.gpus_per_node > 1:
        changes.append((f"--multi-gpu {name}", {"strategy": name}))
    better = []
    for flag, change in changes:
        try:  # the changed request is checked as it is made: a change this run refuses is no advice
            predicted = predict(replace(request, **change, gpus=str(now.gpus)))
        except UsageError:  # not for this run: PowerSGD under a sharding strategy or without the model's matrices
            continue
        if predicted.step_s <= (1 - ADVICE_GAIN) * now.step_s:
            # The model counts PowerSGD's bytes, not its factorisations' compute: that is for a measurement to say.
            caveat = ", its factorisation's compute not counted" if "powersgd" in flag else ""
            faster = f"{now.step_s / predicted.step_s:.1f}x faster{caveat}"
            better.append((predicted.step_s, f"{flag}, {predicted.step_s:.3g} s ({faster})"))
    if not better:
        return None
    options = "; ".join(text for _, text in sorted(better))
    return (
        f"Communication holds up the step across nodes: at {now.gpus} GPUs on {now.nodes} nodes, "
        f"{now.exposed_comm_s:.3g} s of the {now.step_s:.3g} s step is communication that compute does not hide. "
        f"Predicted steps with {options}."
    )
