"""Strategy dp: every replica computes in the precision the run asked for.

DataParallel needs two GPUs to run replicas at all, so this reproduces, on CPU, what torch's parallel_apply does
with each replica: a fresh thread that re-enters autocast with the caller's *enabled* flag only. (tests/gpu runs
the real thing where there are two GPUs.)
"""

from __future__ import annotations

import importlib
import re
import threading

import pytest
import torch
from torch import nn

from multigpu.core.errors import UsageError
from multigpu.strategies import dp
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


class RowSplit:
    """torch's Scatter (CUDA only) as it splits: each GPU's rows, in order, by the sizes given."""

    @staticmethod
    def apply(device_ids, sizes, dim, tensor):
        assert sizes is not None and len(sizes) == len(device_ids)
        return torch.split(tensor, sizes, dim)


def test_batch_shares_give_each_gpu_its_rows_of_every_tensor_in_order(monkeypatch) -> None:
    monkeypatch.setattr(dp, "Scatter", RowSplit)
    x, mask = torch.arange(21.0).reshape(7, 3), torch.arange(7)
    inputs, kwargs = dp.scatter_by_shares((x, "tag"), {"mask": mask, "scale": 2}, [0, 1], (1.0, 2.0))
    # 7 rows by 1:2: GPU 0, which also gathers the outputs, takes 2 (7/3 = 2.3), GPU 1 the other 5.
    assert [part[0].shape[0] for part in inputs] == [2, 5] and [part[1] for part in inputs] == ["tag", "tag"]
    assert torch.equal(torch.cat([part[0] for part in inputs]), x)  # the rows in order: gathered back as they were
    assert [k["mask"].tolist() for k in kwargs] == [[0, 1], [2, 3, 4, 5, 6]] and [k["scale"] for k in kwargs] == [2, 2]


@pytest.mark.parametrize(
    ("shares", "sentence"),
    [
        ("3,1", "batch_shares 3,1 splits each batch over dp's GPUs, and this machine has 0; give one weight per GPU"),
        ("auto", "batch_shares auto measures each process's speed, and dp drives every GPU from one process; give dp"),
    ],
)
def test_dp_shares_that_do_not_fit_the_gpus_are_refused(shares: str, sentence: str) -> None:
    with pytest.raises(UsageError, match="^" + re.escape(sentence)):
        dp.check_gpu_shares(shares, 0 if shares != "auto" else 2)
    dp.check_gpu_shares("1,2", 2)  # one weight per GPU
