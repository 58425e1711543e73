"""EngineConfig: the settings `Engine(...)` takes from a script, each refused in one sentence where no run can use
it (the CLI's flags reach the same checks before launching, tests/test_cli.py)."""

from __future__ import annotations

import math

import pytest
import torch

from multigpu.core.errors import UsageError
from multigpu.engine.config import MAX_TIMEOUT_S, EngineConfig
from multigpu.engine.engine import Engine
from tests.dist import refusal


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"timeout_s": math.nan}, "timeout_s must be a positive number of seconds up to 1,000,000,000"),
        ({"timeout_s": math.inf}, "timeout_s must be a positive number of seconds"),
        ({"timeout_s": 1e15}, "timeout_s must be a positive number of seconds"),  # no timedelta holds it
        ({"timeout_s": MAX_TIMEOUT_S * 1.01}, "timeout_s must be a positive number of seconds"),
        ({"timeout_s": 0.0}, "timeout_s must be a positive number of seconds"),
        ({"max_grad_norm": math.nan}, "max_grad_norm must be a positive finite number (got nan)"),
        ({"max_grad_norm": math.inf}, "max_grad_norm must be a positive finite number (got inf)"),
        ({"peak_tflops": math.nan}, "peak_tflops must be a positive finite number (got nan)"),
        ({"replicate": 0}, "replicate must be 1 or more (got 0)"),
        ({"seed": -1}, "seed must be from 0 to 2**32 - 1"),
        ({"seed": 2**32}, "seed must be from 0 to 2**32 - 1"),
        ({"optimizer": "muon", "momentum": 1.0}, "momentum must be from 0 to below 1 (got 1.0)."),
        ({"optimizer": "muon", "muon_ns_steps": 0}, "muon_ns_steps must be from 1 to 99 (got 0)"),
        ({"beta2": math.nan}, "beta2 must be from 0 to below 1 (got nan)."),
        ({"weight_decay": -0.1}, "weight_decay must be 0 or a positive number (got -0.1)."),
        # What a strategy cannot step: DeepSpeed's flat partitions, zero3's host-memory shards under muon.
        ({"strategy": "deepspeed", "optimizer": "muon"}, "Strategy deepspeed steps its optimizer over flat "),
        ({"strategy": "deepspeed", "optimizer": "adamw-8bit"}, "Strategy deepspeed steps its optimizer over flat "),
        ({"strategy": "zero3", "cpu_offload": True, "optimizer": "muon"}, "optimizer muon gathers each matrix's "),
    ],
)
def test_settings_no_run_can_use_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(UsageError) as refused:
        EngineConfig(**settings)
    assert str(refused.value).startswith(message)


def test_the_bounds_themselves_are_taken() -> None:
    config = EngineConfig(timeout_s=MAX_TIMEOUT_S, seed=2**32 - 1, replicate=1, max_grad_norm=1e-12)
    assert (config.timeout_s, config.seed, config.replicate) == (MAX_TIMEOUT_S, 2**32 - 1, 1)


def test_an_optimizer_setting_is_refused_in_one_line_before_any_worker_starts() -> None:
    printed = refusal("finetune", "--model", "tiny", "--nproc", "2", "--multi-gpu", "deepspeed", "--optimizer", "muon")
    assert printed.strip().splitlines() == [
        "multigpu: error: Strategy deepspeed steps its optimizer over flat partitions of many parameters, which "
        "optimizer muon cannot update; use zero2 or zero3 with it, or adamw under deepspeed."
    ]


def test_an_optimizer_setting_a_script_does_not_build_with_the_engine_is_refused() -> None:
    """A script's own optimizer under --optimizer muon would train with AdamW as if nothing were said."""
    model = torch.nn.Linear(4, 4)
    engine = Engine(strategy="single", optimizer="muon")
    with pytest.raises(UsageError, match=r"optimizer muon is built by engine\.optimizer"):
        engine.setup(model, torch.optim.AdamW(model.parameters()))
    engine.setup(model, engine.optimizer(torch.nn.Sequential(torch.nn.Linear(4, 4), model), lr=1e-3))
