"""EngineConfig: the settings `Engine(...)` takes from a script, each refused in one sentence where no run can use
it (the CLI's flags reach the same checks before launching, tests/test_cli.py)."""

from __future__ import annotations

import math

import pytest

from multigpu.core.errors import UsageError
from multigpu.engine.config import MAX_TIMEOUT_S, EngineConfig


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
    ],
)
def test_settings_no_run_can_use_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(UsageError) as refused:
        EngineConfig(**settings)
    assert str(refused.value).startswith(message)


def test_the_bounds_themselves_are_taken() -> None:
    config = EngineConfig(timeout_s=MAX_TIMEOUT_S, seed=2**32 - 1, replicate=1, max_grad_norm=1e-12)
    assert (config.timeout_s, config.seed, config.replicate) == (MAX_TIMEOUT_S, 2**32 - 1, 1)
