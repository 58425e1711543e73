"""The optimizer's settings, each defined once: which optimizer, its hyperparameters, and what Muon updates.

The recipes build the optimizer from these (optimizers/build.py), a script from `engine.optimizer(model, lr)`, and
the planner counts the states of the one named. The learning rate stays each recipe's own setting: its default
differs with what the recipe trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from multigpu.config.settings import Settings, setting
from multigpu.core.errors import require

#: Every optimizer a run can build, and what the planner counts. sgd is there for scripts that train with it.
OPTIMIZERS = ("adamw", "muon", "adamw-bf16", "adamw-8bit", "adamw-4bit", "sgd")
#: Optimizers whose states are not AdamW's two float32 tensors per parameter.
LOW_BIT = ("adamw-bf16", "adamw-8bit", "adamw-4bit")
#: What cannot step under DeepSpeed, whose ZeRO updates flat partitions of many parameters: Muon finds no matrix
#: there, torchao's low-bit states no tensor of their own. Runs refuse them (strategies/compatibility.py, from
#: deepspeed's composes_with); the planner leaves its DeepSpeed rows out for them.
NOT_UNDER_DEEPSPEED = ("muon", *LOW_BIT)
#: What cannot step with zero3's cpu_offload (a pair of strategies/compatibility.py's table): Muon gathers each
#: matrix's update across ranks, and the offloaded shards live in host memory, which that gather cannot take over
#: NCCL.
NOT_WITH_CPU_OFFLOAD = ("muon",)
#: Which weights Muon orthogonalises (the rest step with AdamW).
MUON_PARAMS = ("hidden", "matrices")
#: How Muon's step size follows a matrix's shape.
MUON_LR_SCALES = ("match-adamw", "original")


@dataclass
class OptimizerSettings(Settings):
    """The optimizer a run builds, and its hyperparameters (the learning rate is the recipe's own)."""

    optimizer: str = setting(
        "adamw",
        "adamw, its states in float32; muon, Newton-Schulz-orthogonalised momentum for the hidden matrices, AdamW "
        "for the rest; adamw-bf16, the states in bfloat16 with stochastic rounding; adamw-8bit and adamw-4bit, the "
        "states block-quantised by torchao (half and a quarter of bf16's bytes); sgd, with momentum",
        choices=OPTIMIZERS,
    )
    weight_decay: float = setting(0.0, "decoupled weight decay (AdamW's and Muon's)")
    beta1: float = setting(0.9, "AdamW's first-moment decay")
    beta2: float = setting(0.999, "AdamW's second-moment decay")
    momentum: float = setting(0.95, "muon's (and sgd's) momentum, applied Nesterov-style")
    muon_ns_steps: int = setting(5, "muon: Newton-Schulz iterations per update")
    muon_params: str = setting(
        "hidden",
        "muon: which weights it updates: hidden, every matrix (and each expert's matrix) but the embeddings and the "
        "output head, which step with AdamW as Moonlight and torchtitan do; matrices, those two too",
        choices=MUON_PARAMS,
    )
    muon_lr_scale: str = setting(
        "match-adamw",
        "muon: its step size per matrix: match-adamw, lr x 0.2 x sqrt(max(rows, columns)), so that one learning "
        "rate suits the matrices and the AdamW parameters alike (Moonlight's); original, lr x sqrt(max(1, rows / "
        "columns)), Keller Jordan's, which wants a learning rate of its own (about 0.02)",
        choices=MUON_LR_SCALES,
    )

    def check(self) -> None:
        # Each range is written as what passes, so that nan, for which every comparison is false, never does.
        require(
            (
                0 <= self.weight_decay < math.inf,
                f"weight_decay must be 0 or a positive number (got {self.weight_decay}).",
            ),
            (0 <= self.beta1 < 1, f"beta1 must be from 0 to below 1 (got {self.beta1})."),
            (0 <= self.beta2 < 1, f"beta2 must be from 0 to below 1 (got {self.beta2})."),
            (0 <= self.momentum < 1, f"momentum must be from 0 to below 1 (got {self.momentum})."),
            (
                1 <= self.muon_ns_steps < 100,
                f"muon_ns_steps must be from 1 to 99 (got {self.muon_ns_steps}); 5 is the usual.",
            ),
        )
