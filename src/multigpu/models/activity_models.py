"""The trainer's two models, described as a list of torch.nn layers so the exported JSON rebuilds them in plain torch:

model = nn.Sequential(*[getattr(nn, name)(*args) for name, *args in config["layers"]])
"""

from __future__ import annotations

from torch import nn

MODES = ("flatten", "conv")


def layer_spec(mode: str, channels: int, window: int, classes: int) -> list[list]:
    if mode == "flatten":  # an MLP on the whole window, as in the guide
        return [
            ["Flatten"],
            ["Linear", channels * window, 256],
            ["ReLU"],
            ["Linear", 256, 128],
            ["ReLU"],
            ["Linear", 128, classes],
        ]
    if mode == "conv":  # a 1-D CNN over time; GroupNorm, not BatchNorm, so N processes compute what 1 does
        return [
            ["Conv1d", channels, 64, 7, 1, 3],
            ["GroupNorm", 8, 64],
            ["ReLU"],
            ["MaxPool1d", 2],
            ["Conv1d", 64, 128, 5, 1, 2],
            ["GroupNorm", 8, 128],
            ["ReLU"],
            ["MaxPool1d", 2],
            ["Conv1d", 128, 128, 3, 1, 1],
            ["GroupNorm", 8, 128],
            ["ReLU"],
            ["AdaptiveAvgPool1d", 1],
            ["Flatten"],
            ["Linear", 128, classes],
        ]
    raise ValueError(f"unknown mode {mode!r}")


def tp_plan(mode: str) -> dict[str, str]:
    """Under tensor parallelism the MLP's first hidden layer is split by outputs, the second sums the slices (the
    ReLU between works on each slice); the CNN has no plan."""
    return {"1": "colwise", "3": "rowwise"} if mode == "flatten" else {}


def build(spec: list[list]) -> nn.Sequential:
    return nn.Sequential(*[getattr(nn, name)(*args) for name, *args in spec])
