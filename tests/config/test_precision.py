"""Precision casts keep the model's outputs as the model returned them, only wider."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from multigpu.config.precision import PRECISIONS, Precision
from multigpu.strategies.single import Single

Pair = namedtuple("Pair", "loss logits")


@dataclass
class Output:
    loss: torch.Tensor
    extras: dict


def hf_output(loss: torch.Tensor, logits: torch.Tensor):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != "32"])
@pytest.mark.parametrize("kind", ["model_output", "dataclass", "namedtuple", "dict"])
def test_outputs_keep_their_type_and_come_back_in_fp32(precision: str, kind: str) -> None:
    linear = nn.Linear(4, 4)
    if precision == "bf16-true":
        linear.to(torch.bfloat16)

    def forward(x: torch.Tensor):
        logits = linear(x)
        loss = logits.sum()
        return {
            "model_output": lambda: hf_output(loss, logits),
            "dataclass": lambda: Output(loss, {"logits": logits}),
            "namedtuple": lambda: Pair(loss, logits),
            "dict": lambda: {"loss": loss, "logits": logits},
        }[kind]()

    cpu = torch.device("cpu")
    wrapped = Single().precision_plan(Precision(precision), cpu).wrap_forward(forward, cpu)
    out = wrapped(torch.randn(2, 4))
    from transformers.modeling_outputs import CausalLMOutputWithPast

    assert (
        type(out)
        is {"model_output": CausalLMOutputWithPast, "dataclass": Output, "namedtuple": Pair, "dict": dict}[kind]
    )
    loss = out["loss"] if isinstance(out, dict) else out.loss
    logits = out.extras["logits"] if kind == "dataclass" else (out["logits"] if kind == "dict" else out.logits)
    assert loss.dtype == torch.float32 and logits.dtype == torch.float32
    if kind == "model_output":  # attribute and item access must agree, as transformers relies on both
        assert out.logits is out["logits"] and out.to_tuple()[1].dtype == torch.float32
