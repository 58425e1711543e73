"""A node of different GPUs: how `--gpus` names them, and the batch shares their memory holds."""

from __future__ import annotations

import pytest

from multigpu.core.errors import UsageError
from multigpu.planner import plan
from multigpu.planner.gpus import GpuKind, node_gpus, quickest_split, shares_that_fit
from tests.dist import refusal

GiB = 2**30


def test_a_node_is_a_count_or_its_gpus_one_by_one_or_in_groups() -> None:
    assert node_gpus(2, "24GB") == [GpuKind(None, 24 * GiB, None)] * 2
    assert node_gpus("2", "24GB") == node_gpus(2, "24GB")
    mixed = node_gpus("4xH100-80GB,4xA100-40GB", "80GB")
    assert mixed == [GpuKind("H100", 80 * GiB, 989.4)] * 4 + [GpuKind("A100", 40 * GiB, 312.0)] * 4
    assert node_gpus("2x80GB,24GB", "80GB") == [GpuKind(None, 80 * GiB, None)] * 2 + [GpuKind(None, 24 * GiB, None)]
    assert [gpu.label for gpu in node_gpus("rtx4090-24GB,48GB", "80GB")] == ["RTX4090-24GB", "48GB"]
    for text, words in [
        ("4xB300-288GB", "--gpus names a GPU 'B300' whose speed is not known; name one of H100, H200"),
        ("4x80", "--gpus 80 has no unit"),
        ("0x80GB", "--gpus '0x80GB' must list one value per GPU or COUNTxVALUE groups of them"),
        (0, "--gpus must be 1 or more (got 0)."),
    ]:
        with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
            node_gpus(text, "80GB")


def test_shares_follow_speed_within_what_each_gpu_holds() -> None:
    assert shares_that_fit([23, 23, 9, 9], [989, 989, 312, 312], 32) == [12, 12, 4, 4]  # by speed: 12.2, 3.8
    # The fast GPUs hold 10 each: the rest goes to the slow ones, still by speed between them.
    assert shares_that_fit([10, 10, 9, 9], [989, 989, 312, 312], 32) == [10, 10, 6, 6]
    assert shares_that_fit([10, 10, 3, 3], [989, 989, 312, 312], 26) == [10, 10, 3, 3]
    assert shares_that_fit([10, 10, 3, 3], [989, 989, 312, 312], 27) is None  # more than they hold together
    assert shares_that_fit([100, 100], [1000, 1], 10) == [9, 1]  # each GPU keeps at least one sample
    assert shares_that_fit([100, 0], [1, 1], 10) is None  # a GPU that holds none


def test_the_quickest_split_counts_each_rank_fixed_work_per_step() -> None:
    # 1 s a sample against 2 s: in proportion to speed, 11 and 5 (steps of 11 s and 10 s).
    assert quickest_split([16, 16], [0.0, 0.0], [1.0, 2.0], 16) == [11, 5]
    # The slow rank also spends 6 s a step whatever its part: 13 and 3 (13 s and 12 s) beat 12 and 4 (12 s, 14 s).
    assert quickest_split([16, 16], [0.0, 6.0], [1.0, 2.0], 16) == [13, 3]
    assert quickest_split([10, 16], [0.0, 6.0], [1.0, 2.0], 16) == [10, 6]  # rank 0 holds 10: the rest to rank 1
    assert quickest_split([10, 5], [0.0, 6.0], [1.0, 2.0], 16) is None  # more than they hold together
    assert quickest_split([16, 16], [0.0, 100.0], [1.0, 1.0], 16) == [15, 1]  # each rank keeps at least one
    assert quickest_split([4] * 4, [1.0] * 4, [1.0] * 4, 10) == [3, 3, 2, 2]  # ties to the lower rank


def test_a_mixed_node_runs_what_its_smallest_gpu_alone_cannot_by_giving_it_less() -> None:
    """8B under full checkpointing, 8 x 2048 tokens per GPU: 40 GiB holds 5 sequences beside zero3's states, 80
    GiB 15, so no even split runs, while 12 on each H100 and 4 on each A100 does (and follows their speeds)."""
    settings = {"batch_size": 8, "seq_len": 2048, "activation_checkpointing": "full"}
    mixed = plan("llama-3.1-8b", gpus="4xH100-80GB,4xA100-40GB", **settings)
    small = plan("llama-3.1-8b", gpus=8, gpu_memory="40GB", **settings)
    assert mixed.config.world == 8 and mixed.config.gpu_bytes == 40 * GiB
    assert [m.total for m in mixed.strategies] == [m.total for m in small.strategies]  # the table: the smallest's
    assert small.recommendation is None and small.mixed is None
    assert mixed.recommendation == "zero3" and "only shares that give the smaller GPUs less fit" in mixed.reason
    shares = mixed.mixed
    assert shares is not None and shares.by == "speed" and shares.global_batch == 64
    assert shares.gpus == ["H100-80GB"] * 4 + ["A100-40GB"] * 4 and shares.most == [15] * 4 + [5] * 4
    assert shares.slices == [12] * 4 + [4] * 4  # by speed 989:312 is 12.2:3.8, within 15 and 5
    # At half the batch a faster strategy holds it, split the same way; without names, by what each holds.
    half = plan("llama-3.1-8b", gpus="4xH100-80GB,4xA100-40GB", **{**settings, "batch_size": 4})
    assert half.recommendation == "zero2" and half.mixed is not None and half.mixed.slices == [6] * 4 + [2] * 4
    by_memory = plan("llama-3.1-8b", gpus="4x80GB,4x40GB", **settings).mixed
    assert by_memory is not None and by_memory.by == "memory" and by_memory.slices == [12] * 4 + [4] * 4


def test_cli_prints_what_each_gpu_holds_and_the_shares() -> None:
    from tests.dist import multigpu

    args = ["plan", "--model", "llama-3.1-8b", "--gpus", "4xH100-80GB,4xA100-40GB", "--batch-size", "8"]
    result = multigpu(*args, "--seq-len", "2048", "--activation-checkpointing", "full", timeout=60)
    assert result.returncode == 0, result.stdout
    assert "4 x H100-80GB (989.4 TFLOPS), 4 x A100-40GB (312 TFLOPS) per node: the table is for the smallest" in (
        result.stdout
    )
    assert "under zero3 each GPU holds at most H100-80GB 15, A100-40GB 5 sequences of 2048 tokens" in result.stdout
    assert "batch shares by speed within memory: --batch-shares 12,12,12,12,4,4,4,4 (the global batch of 64" in (
        result.stdout
    )
    printed = refusal("plan", "--model", "llama-3.1-8b", "--gpus", "2x80GB,40GB", "--gpu-memory", "24GB")
    assert printed.strip() == "multigpu: error: --gpus 2x80GB,40GB gives each GPU's memory; drop --gpu-memory 24GB."
