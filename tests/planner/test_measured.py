"""The planner against measurement: tensors each rank really holds, and bytes autograd really saves."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import multigpu as mg
from multigpu.planner import plan
from multigpu.planner.activations import transformer_activations
from multigpu.planner.shapes import from_config
from multigpu.transforms.recompute import recompute_blocks
from tests.dist import run_in_processes


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update, as peft builds it."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def stack(lora: bool) -> nn.Module:
    layers = [nn.Linear(256, 256) for _ in range(8)]
    return nn.Sequential(*[LoRALinear(layer, 8) if lora else layer for layer in layers])


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def measure(strategy: str, lora: bool) -> dict[str, int]:
    """After one optimizer step: bytes of parameters, gradients and optimizer states this rank holds."""
    engine = mg.Engine(strategy=strategy)
    model = stack(lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model, optimizer = engine.setup(model, optimizer)
    engine.backward(model(torch.randn(4, 256)).pow(2).mean())
    optimizer.step()
    inner = optimizer.optim if strategy == "zero1" else optimizer
    states = [t for s in inner.state.values() for key, t in s.items() if key != "step"]
    return {
        "params": sum(local_bytes(p) for p in model.parameters()),
        "grads": sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer": sum(local_bytes(t) for t in states),
    }


CASES = [("ddp", False), ("zero1", False), ("zero2", False), ("zero3", False), ("ddp", True), ("zero3", True)]


def measure_all() -> list[dict[str, int]]:
    return [measure(strategy, lora) for strategy, lora in CASES]


def test_model_states_match_what_each_rank_holds() -> None:
    measured = run_in_processes("tests.planner.test_measured:measure_all", 2, timeout=180)
    for index, (strategy, lora) in enumerate(CASES):
        rows = {m.strategy: m for m in plan(stack(lora), gpus=2, precision="32", optimizer="adamw").strategies}
        for rank in range(2):
            for part, value in measured[rank][index].items():
                want = getattr(rows[strategy], part)
                assert value == pytest.approx(want, rel=0.05), f"{strategy} lora={lora} rank {rank} {part}"


def measure_deepspeed(stage: int, lora: bool) -> dict[str, int]:
    """The same after one DeepSpeed step; DeepSpeed frees its gradient partitions inside the step."""
    engine = mg.Engine(strategy="deepspeed", zero_stage=stage)
    model = stack(lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model, optimizer = engine.setup(model, optimizer)
    engine.backward(model(torch.randn(4, 256)).pow(2).mean())
    engine.step(optimizer)
    # `optimizer` is the torch optimizer DeepSpeed steps; its states are keyed by this rank's fp32 master partitions.
    masters = list(optimizer.state)
    weights = [getattr(p, "ds_tensor", p) for p in model.module.parameters()]  # ZeRO-3 holds a partition
    states = [t for s in optimizer.state.values() for key, t in s.items() if key != "step"]
    return {
        "params": sum(local_bytes(t) for t in weights + masters),
        "optimizer": sum(local_bytes(t) for t in states),
    }


DEEPSPEED_CASES = [(1, False), (2, False), (3, False), (3, True)]


def measure_all_deepspeed() -> list[dict[str, int]]:
    return [measure_deepspeed(stage, lora) for stage, lora in DEEPSPEED_CASES]


def test_deepspeed_model_states_match_what_each_rank_holds() -> None:
    measured = run_in_processes("tests.planner.test_measured:measure_all_deepspeed", 2, timeout=180)
    for index, (stage, lora) in enumerate(DEEPSPEED_CASES):
        rows = {m.strategy: m for m in plan(stack(lora), gpus=2, precision="32", optimizer="adamw").strategies}
        for rank in range(2):
            for part, value in measured[rank][index].items():
                want = getattr(rows[f"deepspeed{stage}"], part)
                assert value == pytest.approx(want, rel=0.05), f"deepspeed{stage} lora={lora} rank {rank} {part}"


def saved_bytes(model: nn.Module, forward) -> int:
    """Bytes of the distinct storages autograd keeps for backward during `forward()`, parameters excluded.

    Written apart from the planner's own measurement on purpose: this is the oracle it is checked against."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in params:
            seen[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(seen.values())


TINY_LLAMA = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


def tiny_llama(checkpointing: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA, attn_implementation="sdpa"))
    recompute_blocks(model, model.model.layers, checkpointing)
    return model.train()


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize(("batch", "seq"), [(2, 64), (4, 128), (1, 256)])
def test_transformer_activations_match_saved_tensors(batch: int, seq: int, checkpointing: str) -> None:
    model = tiny_llama(checkpointing)
    ids = torch.randint(0, 512, (batch, seq))
    measured = saved_bytes(model, lambda: model(input_ids=ids, labels=ids))
    predicted = transformer_activations(from_config(TINY_LLAMA, "tiny").transformer, batch, seq, "32", checkpointing)
    assert predicted.saved == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_the_activation_peak_of_each_checkpointing_mode_is_the_planned_one(checkpointing: str) -> None:
    """The peak of everything but parameters and gradients over a step, followed tensor by tensor by torch's
    MemTracker, once the gradients exist (as from a loop's second step). offload keeps its activations in host
    memory, which on this CPU is the device: its figure is checked on a GPU (tests/gpu)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, ids = tiny_llama(checkpointing), torch.randint(0, 512, (4, 128))
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=False)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    held = sum(value for kind, value in peak.items() if kind != "Total" and kind.value in ("Parameter", "Gradient"))
    predicted = transformer_activations(from_config(TINY_LLAMA, "tiny").transformer, 4, 128, "32", checkpointing)
    assert predicted.peak == pytest.approx(peak["Total"] - held, rel=0.15)


def test_module_activations_come_from_a_traced_forward() -> None:
    from multigpu.models.activity_models import build, layer_spec

    model = build(layer_spec("conv", 6, 128, 7))
    result = plan(model, sample_input=torch.randn(1, 6, 128), precision="32", batch_size=16)
    ddp = next(m for m in result.strategies if m.strategy == "ddp")
    x = torch.randn(16, 6, 128)
    assert ddp.activations == pytest.approx(saved_bytes(model, lambda: model(x)), rel=0.15)
