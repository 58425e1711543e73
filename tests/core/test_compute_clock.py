"""A rank's compute clock: what it counts, and the one sentence where a CPU cannot be measured."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from multigpu.core import compute_clock
from multigpu.core.errors import UsageError


def test_a_sleep_costs_the_clock_nothing_and_compute_counts() -> None:
    """A wait in a collective sleeps: it must not count as compute, or every rank would measure the slowest one's
    pace; a busy thread counts its time on the CPU."""
    start = compute_clock.cpu_demand_s()
    threading.Event().wait(0.2)
    slept = compute_clock.cpu_demand_s() - start
    start = compute_clock.cpu_demand_s()
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    busy = compute_clock.cpu_demand_s() - start
    assert slept < 0.02 and busy >= 0.05
    assert compute_clock.probe_s(torch.device("cpu")) > 0 and compute_clock.probe_tflop("cpu") == pytest.approx(
        2 * 512**3 * 10 / 1e12
    )


def test_a_cpu_without_schedstat_is_refused_in_one_sentence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(compute_clock, "SCHEDSTAT", tmp_path / "schedstat")
    with pytest.raises(UsageError, match=r"^batch_shares auto measures each CPU rank's compute from the kernel's "):
        compute_clock.check_measurable("cpu", "batch_shares")
    compute_clock.check_measurable("cuda", "batch_shares")  # a GPU's speed is timed with CUDA events
