"""Strategy dp: every replica computes in the precision the run asked for.

DataParallel needs two GPUs to run replicas at all, so this reproduces, on CPU, what torch's parallel_apply does
with each replica: a fresh thread that re-enters autocast with the caller's *enabled* flag only. (tests/gpu runs
the real thing where there are two GPUs.)
"""

from __future__ import annotations

import importlib
import threading

import pytest
import torch
from torch import nn

from multigpu.strategies.dp import AutocastDataParallel


def threaded_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """torch's parallel_apply, reduced to what decides the dtype: a thread per replica, autocast(enabled=...)."""
    enabled, results = torch.is_autocast_enabled("cpu"), {}

    def work(index: int) -> None:
        with torch.autocast("cpu", enabled=enabled):  # CPU's default autocast dtype is bf16
            results[index] = modules[index](*inputs[index])

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(modules))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[index] for index in range(len(modules))]


@pytest.mark.parametrize("wrapper", [nn.DataParallel, AutocastDataParallel])
def test_replicas_compute_in_the_callers_autocast_dtype(monkeypatch, wrapper) -> None:
    # The module (the package exports a function of the same name): nn.DataParallel looks parallel_apply up there.
    monkeypatch.setattr(
        importlib.import_module("torch.nn.parallel.data_parallel"), "parallel_apply", threaded_parallel_apply
    )
    replicas = [nn.Linear(4, 4), nn.Linear(4, 4)]
    model = wrapper(nn.Linear(4, 4))
    model.src_device_obj, model.device_ids = torch.device("cpu"), [0, 1]  # as on two GPUs
    inputs = [(torch.randn(2, 4),), (torch.randn(2, 4),)]
    with torch.autocast("cpu", dtype=torch.float16):  # not the thread default, so a lost dtype shows
        outputs = model.parallel_apply(replicas, inputs, [{}, {}])
    dtypes = {output.dtype for output in outputs}
    if wrapper is nn.DataParallel:
        assert dtypes == {torch.bfloat16}  # torch's own loses the dtype: what this strategy exists to fix
    else:
        assert dtypes == {torch.float16}
