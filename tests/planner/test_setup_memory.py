"""Setup memory: a rank's peak while its model is built, whole or under engine.init_module(), beside training's."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from multigpu.cli import main
from multigpu.planner import ModelShape, choose_strategy, plan
from multigpu.planner.memory import FRAMEWORK_OVERHEAD

GIB = 2**30
LLAMA_8B_FP32 = 8_030_261_248 * 4  # llama-3.1-8b's parameters, built in fp32
SMALL_LLAMA = {"gpus": 8, "batch_size": 1, "seq_len": 512, "activation_checkpointing": "full"}  # zero3 fits 24GB


def by_strategy(result) -> dict:
    return {m.strategy: m for m in result.strategies}


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "bf16-true"])
def test_a_plain_build_holds_the_whole_fp32_model_on_every_rank(precision: str) -> None:
    """7e9 parameters without dimensions: the unit and the largest tensor both fall back to a tenth of the model."""
    rows = by_strategy(plan(ModelShape(params=7_000_000_000), gpus=8, precision=precision))
    fsdp = ("zero2", "zero3", "zero3+offload")  # fully_shard copies the slices out of the whole: 1 + 1/8
    assert {name: m.setup for name, m in rows.items()} == {name: 28e9 * (9 / 8 if name in fsdp else 1) for name in rows}
    for name in ("ddp", "zero1", "deepspeed1", "deepspeed2"):  # every rank needs the whole model anyway
        assert rows[name].setup_init_module == 28e9
    for name in ("zero2", "zero3", "zero3+offload"):  # shard + the tensor rank 0 scatters (units built on the host)
        assert rows[name].setup_init_module == 28e9 / 8 + 7e8 * 4
    assert rows["deepspeed3"].setup_init_module == 28e9 / 8 + 2 * 7e8 * 4  # zero.Init: + one unit + one tensor


def test_init_module_holds_a_shard_and_one_tensor_or_a_layer() -> None:
    """llama-2-7b: the largest unit is a decoder layer, the largest tensor the embedding (32000 x 4096). zero3's
    rank 0 builds the layer in host memory and scatters the embedding from the GPU; zero.Init builds both there."""
    rows = by_strategy(plan("llama-2-7b", gpus=8))
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert rows["zero3"].setup == 26_953_662_464 * 9 / 8 and 26_953_662_464 == 6_738_415_616 * 4
    assert rows["zero3"].setup_init_module == 26_953_662_464 / 8 + 32000 * 4096 * 4 == 3_893_495_808
    assert rows["deepspeed3"].setup_init_module == 26_953_662_464 / 8 + layer * 4 + 32000 * 4096 * 4
    assert rows["zero1"].setup_init_module == rows["zero1"].setup


def test_qlora_builds_the_quantised_model() -> None:
    ddp = by_strategy(plan("llama-2-7b", gpus=2, lora_r=16, qlora=True))["ddp"]
    assert ddp.setup == ddp.params < 6_738_415_616 * 4 / 5


def test_the_warning_appears_exactly_when_the_plain_build_binds() -> None:
    """zero2 trains in 31.92 GiB; its plain build needs the whole fp32 model and its slice, plus the overhead."""
    edge = LLAMA_8B_FP32 * 9 / 8 + FRAMEWORK_OVERHEAD
    fits = plan("llama-3.1-8b", gpu_memory=f"{edge}B", **SMALL_LLAMA)
    binds = plan("llama-3.1-8b", gpu_memory=f"{edge - 1}B", **SMALL_LLAMA)
    assert fits.recommendation == binds.recommendation == "zero2"
    assert by_strategy(fits)["zero2"].setup_fits == "yes" and fits.setup_warning == ""
    assert by_strategy(binds)["zero2"].setup_fits == "with init_module"
    assert binds.setup_warning.startswith("zero2's training fits, but setup does not")
    assert "build it under engine.init_module()" in binds.setup_warning
    roomy = plan("llama-3.1-8b", gpu_memory="80GB", **SMALL_LLAMA)
    assert roomy.recommendation == "zero2" and roomy.setup_warning == ""


def test_a_setup_that_init_module_cannot_shrink() -> None:
    """bf16-true trains bf16 weights but builds them in fp32: ddp's LoRA run fits 24GB, its 27 GB build does not."""
    result = plan("llama-2-7b", gpus=2, gpu_memory="24GB", precision="bf16-true", lora_r=16, batch_size=1, seq_len=512)
    assert result.recommendation == "ddp" and by_strategy(result)["ddp"].setup_fits == "no"
    assert "build the model in bf16 directly" in result.setup_warning


def test_auto_names_init_module_unless_the_model_is_already_on_meta() -> None:
    """Eight ranks shard 16 layers' training states below one whole fp32 copy: zero3 fits, its plain build not."""
    memory = FRAMEWORK_OVERHEAD + 50 * 2**20

    def pick(device: str) -> tuple[str, str]:
        with torch.device(device):
            model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
        return choose_strategy(model, "adamw", 8, 1, memory, "32", offload_possible=False)

    built, meta = pick("cpu"), pick("meta")
    assert built[0] == meta[0] == "zero3"
    assert "engine.init_module()" in built[1] and "engine.init_module()" not in meta[1]


def test_json_adds_the_setup_keys(capsys: pytest.CaptureFixture) -> None:
    main(["plan", "--model", "llama-3.1-8b", "--json", *("--gpus", "8", "--gpu-memory", "24GB", "--batch-size", "1")])
    data = json.loads(capsys.readouterr().out)
    kept = {"strategy", "params", "grads", "optimizer", "activations", "temporary", "overhead", "cpu", "total", "fits"}
    for row in data["strategies"]:
        assert kept | {"max_batch_size", "setup", "setup_init_module", "setup_fits"} <= row.keys()
    assert "reason" in data and "recommendation" in data and "setup_warning" in data


def table(capsys: pytest.CaptureFixture, *extra: str) -> tuple[str, str]:
    """`multigpu plan` for llama-3.1-8b on 8 x 24GB: its output, and zero3's row."""
    main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-memory", "24GB", *extra])
    out = capsys.readouterr().out
    return out, next(line for line in out.splitlines() if " zero3 " in line)


def test_the_table_shows_setup_beside_training(capsys: pytest.CaptureFixture) -> None:
    out, zero3 = table(capsys)
    assert "setup" in out and "init_module" in out
    assert f"{LLAMA_8B_FP32 * 9 / 8 / GIB:.2f}" in zero3 and "5.70" in zero3  # 3.74 shard + 1.96 (the embedding)
    assert "warning:" not in out  # nothing trains at batch 8, so nothing is recommended
    out, zero3 = table(capsys, "--batch-size", "1", "--activation-checkpointing", "full")
    assert "init_module" in zero3.split("│")[-5]  # the fits column
    assert "warning: zero3's training fits, but setup does not" in " ".join(out.split())
