"""AdamW with its two states in fewer bits: bfloat16 (adamw-bf16), or block-quantised to 8 or 4 bits by torchao.

torchao stores the 8- and 4-bit states as tensor subclasses (one scale per block of 256 or 128 values, tensors of
under 4,096 values left in float32) and wraps them as DTensors shaped like zero2/zero3's shards, so each rank
quantises its own shard. Two things here are ours:

- The step runs torchao's per-parameter update on each rank's local tensors, compiled on GPUs as torchao runs it,
  eagerly on the CPU, where inductor's compile for each parameter shape takes longer than a test's whole training
  (17 s before the first step of a 3-layer MLP on this project's 2-core machine).
- bfloat16 states round stochastically, or an exp_avg_sq moving by (1 - 0.999) of itself would never move at all
  (bfloat16 has 8 bits of mantissa). The rounding noise is a hash of each value and the step count, not a draw from
  a generator: 1 process and N round alike, a resumed run rounds as the uninterrupted one, and the run's random
  streams are left alone.

Checkpoints hold the quantised states as float32 values (`state_dict`), which DCP can save and reshard; a load
quantises them again. At the world size they were saved at that is exact (saved_values says how); at another, the
blocks fall on other values, and the states come back within the quantisation's own rounding. Each of these takes
another AdamW's checkpoint, and each other AdamW theirs (optimizers/convert.py, through quantised_values).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchao.optim import AdamW4bit as _TorchaoAdamW4bit
from torchao.optim import AdamW8bit as _TorchaoAdamW8bit
from torchao.optim import _AdamW
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_4bit import OptimState4bit
from torchao.optim.subclass_8bit import OptimState8bit

_GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


class _LocalStep:
    """torchao's AdamW step, per parameter, on each rank's local tensors; lr stays a float in the param groups, as
    schedulers and checkpoints expect (torchao keeps it a tensor); checkpoints as the module's docstring says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _checkpoint_dequantised(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        torch.optim.Optimizer.add_param_group(self, param_group)  # type: ignore[arg-type]

    @staticmethod
    def _update(*args: Any) -> None:
        single_param_adam(*args)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch._dynamo.utils.disable_cache_limit():  # one compile per parameter shape, as torchao allows
            for group in self.param_groups:  # type: ignore[attr-defined]
                for param in group["params"]:
                    if param.grad is not None:
                        self._step_one(param, group)
        return loss

    def _step_one(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]  # type: ignore[attr-defined]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(param, True)  # type: ignore[attr-defined]
            state["exp_avg_sq"] = self._new_buffer(param, False)  # type: ignore[attr-defined]
        state["step"] += 1
        update = self._update
        if param.device.type != "cpu":
            update = torch.compile(update, fullgraph=True, dynamic=False)
        beta1, beta2 = group["betas"]
        update(
            _local(param.detach()),
            _local(param.grad),
            state["step"],
            _local(state["exp_avg"]),
            _local(state["exp_avg_sq"]),
            None,
            torch.tensor(group["lr"], dtype=torch.float32),
            beta1,
            beta2,
            group["weight_decay"],
            group["eps"],
            True,
            False,
        )


class _QuantisedAsWhole:
    """torchao quantises a state whose local tensor has 4,096 values or more: a zero3 shard of a 64 x 64 matrix
    would stay float32 where one process quantises the whole. Here the whole tensor's size decides (with a shard
    that fills whole blocks), so that N processes quantise what one does, in the same blocks where the shards'
    edges fall on blocks' edges."""

    def _new_buffer(self, param: torch.Tensor, signed: bool) -> torch.Tensor:
        local = _local(param)
        if _quantises(param.numel(), local, self.block_size):  # type: ignore[attr-defined]
            state = self._subclass_zeros(local, signed, self.block_size)  # type: ignore[attr-defined]
        else:
            state = torch.zeros_like(local)
        return rewrapped(param, state).to(param.device)  # offloaded shards stay on the host


class AdamW8bit(_QuantisedAsWhole, _LocalStep, _TorchaoAdamW8bit):
    """torchao's AdamW8bit (states in 8 bits, a scale per 256), stepping and checkpointing as described above."""

    KIND = "adamw-8bit"  # the optimizer setting that builds it (optimizers/convert.py)


class AdamW4bit(_QuantisedAsWhole, _LocalStep, _TorchaoAdamW4bit):
    """torchao's AdamW4bit (states in 4 bits, a scale per 128), stepping and checkpointing as described above."""

    KIND = "adamw-4bit"


class AdamWBf16(_LocalStep, _AdamW):
    """AdamW with both states in bfloat16, rounded stochastically by a hash (above); the update itself in float32."""

    KIND = "adamw-bf16"

    def _new_buffer(self, param: torch.Tensor, signed: bool) -> torch.Tensor:
        return torch.zeros_like(param, dtype=torch.bfloat16)

    @staticmethod
    def _update(param: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, _max_sq: Any, lr: torch.Tensor, beta1: float, beta2: float,
                weight_decay: float, eps: float, *_flags: Any) -> None:  # fmt: skip
        grad32 = grad.float()
        average = exp_avg.float().lerp(grad32, 1 - beta1)
        square = exp_avg_sq.float().lerp(grad32.square(), 1 - beta2)
        exp_avg.copy_(hashed_round(average, step, salt=1))
        exp_avg_sq.copy_(hashed_round(square, step, salt=2))
        denom = square.sqrt() / (1 - beta2**step).sqrt() + eps
        updated = param.float() * (1 - lr * weight_decay) - lr * (average / (1 - beta1**step)) / denom
        param.copy_(updated)


def hashed_round(values: torch.Tensor, step: torch.Tensor, salt: int) -> torch.Tensor:
    """float32 `values` rounded to bfloat16 up or down, with the probability of each in proportion to its distance
    (stochastic rounding), the noise a hash of each value's bits, the step and `salt` (murmur3's finaliser)."""
    bits = values.view(torch.int32).to(torch.int64) & _MASK32
    # The step stays a tensor (no .item()), so that the compiled update on GPUs is one graph.
    mixed = (bits ^ ((step.to(torch.int64) * _GOLDEN + salt * 0x632BE5AB) & _MASK32)) & _MASK32
    mixed = ((mixed ^ (mixed >> 16)) * 0x85EBCA6B) & _MASK32
    mixed = ((mixed ^ (mixed >> 13)) * 0xC2B2AE35) & _MASK32
    mixed ^= mixed >> 16
    # Adding noise below the 16 bits bfloat16 drops carries into what it keeps with the chance they stand for.
    kept = (bits + (mixed & 0xFFFF)) & 0xFFFF0000
    signed = torch.where(kept >= 2**31, kept - 2**32, kept).to(torch.int32)
    return signed.view(torch.float32).to(torch.bfloat16)


def quantised_values(kind: str, local: torch.Tensor, numel: int, signed: bool) -> torch.Tensor:
    """The float32 values an optimizer `kind` (adamw-8bit or adamw-4bit) holds of a state's values `local` (this
    rank's part of a state of `numel` values): quantised in its blocks and read back, as its load quantises them
    and each of its steps quantises what it computed. A checkpoint's values (saved_values) come back as the
    states that were saved, where the blocks fall as they fell then."""
    optimizer = {AdamW8bit.KIND: AdamW8bit, AdamW4bit.KIND: AdamW4bit}[kind]
    block = _block_size(optimizer)
    values = local.float()
    if not _quantises(numel, values, block):
        return values
    state = optimizer._subclass_zeros(values, signed, block)
    state.copy_(values)
    return state.dequantize()


def _block_size(optimizer: type) -> int:
    """The block size an optimizer of ours quantises in: its torchao class's default, which build_optimizer keeps."""
    torchao_class = next(base for base in optimizer.__mro__ if base.__module__.startswith("torchao."))
    return inspect.signature(torchao_class).parameters["block_size"].default


def _quantises(numel: int, local: torch.Tensor, block: int) -> bool:
    """Whether a state of `numel` values in all, `local` of them on this rank, is quantised (_QuantisedAsWhole)."""
    return numel >= 4096 and local.numel() % block == 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_quantised(tensor: torch.Tensor) -> bool:
    return isinstance(_local(tensor), (OptimState8bit, OptimState4bit))


def _checkpoint_dequantised(optimizer: Any) -> None:
    """The optimizer's state_dict holds float32 states in place of the quantised ones; a load quantises them again
    (and keeps bfloat16 states bfloat16)."""

    def dequantised(_optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        # The entries are the optimizer's own state dicts: replaced, not changed, so that it keeps its states.
        for index, entry in state_dict["state"].items():
            state_dict["state"][index] = {
                key: rewrapped(value, saved_values(_local(value))) if _is_quantised(value) else value
                for key, value in entry.items()
            }
        return state_dict

    def quantised_again(_optimizer: Any) -> None:
        # torch's load casts the states to the parameter's dtype: back to bfloat16, or quantised.
        for param, state in optimizer.state.items():
            for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                loaded = state.get(key)
                if loaded is None or _is_quantised(loaded):
                    continue
                fresh = optimizer._new_buffer(param, signed)
                if _is_quantised(fresh) or fresh.dtype != loaded.dtype:
                    _local(fresh).copy_(_local(loaded))
                    state[key] = fresh

    optimizer.register_state_dict_post_hook(dequantised)
    optimizer.register_load_state_dict_post_hook(quantised_again)


def saved_values(state: Any) -> torch.Tensor:
    """A quantised state's values, which quantise back to the same codes and scales: each block's scale is its
    largest magnitude, but the signed maps end at 1 and at -0.99 (8 bits; -0.89 at 4), so a block whose largest
    magnitude was negative is saved with that element at -scale, the value it was quantised from, not -0.99 x
    scale, which would come back with a smaller scale."""
    values = state.dequantize()
    lowest = state.qmap.min()
    if lowest >= 0:
        return values
    blocks, scale = values.view(state.scale.shape[0], -1), state.scale.view(-1, 1)
    return torch.where(blocks == lowest * scale, -scale, blocks).view(values.shape)


def rewrapped(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as `like` holds its values: as this rank's part of a DTensor like it, or as it is."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())  # fmt: skip
