"""A language model's token loss, computed so that the whole logits tensor need never exist.

The loss of a batch is (the cross-entropy summed over its target tokens, their number): engine.backward(loss,
count=...) divides by the count of the whole global batch, so every mode and layout trains on one exact
token-normalised loss. Targets are aligned with the hidden states already; `ignore_index` (-100, as Hugging Face's)
marks the tokens left out.

- plain: the output head's logits for every token ([tokens, vocabulary], in fp32), then the cross-entropy.
- chunked: the head and the loss a slice of tokens at a time (torch, any device). Each slice's forward also computes
  its gradients with respect to the hidden states and the head's weight (the "gradients in forward" technique of
  Liger-Kernel's fused loss), so neither the logits nor their gradient is ever held for more than one slice, and
  backward only scales the kept gradients by the loss's own gradient. Under tensor parallelism the head's weight is
  split by vocabulary (a DTensor on the "tp" mesh): each process computes its slice of the vocabulary's logits and
  one all-reduce per chunk gives every process the log-sum-exp over the whole vocabulary and the target's logit.
- fused: Liger-Kernel's fused linear cross-entropy (Triton: CUDA GPUs only).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from multigpu.core.errors import UsageError, require
from multigpu.core.lazy import is_dtensor

MODES = ("plain", "chunked", "fused")
IGNORE_INDEX = -100
#: The mesh dimension whose processes split a head by vocabulary (parallel/mesh.py names it).
TENSOR_DIM = "tp"
#: What one chunk's fp32 logits may take by default: small beside the whole logits of a long batch (2048 x 49,152 x
#: 4 B = 384 MiB) and beside the head's gradient; measured on CPU (docs/benchmarks.md), smaller chunks save little
#: more and run no faster, larger ones hold more and run slower.
CHUNK_BYTES = 32 * 2**20


def summed_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of `logits` [..., vocabulary] summed over the targets that are not `ignore_index`, their
    number): the plain loss, computed in fp32."""
    loss = nn.functional.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    return loss, (targets != ignore_index).sum()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    mode: str = "chunked",
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of the logits `hidden @ weight.T` summed over the targets that are not `ignore_index`, their
    number), computed as `mode` says (the module's docstring). `hidden` is [..., features], `targets` its leading
    shape; `weight` is the output head's [vocabulary, features], or its vocabulary split over the "tp" mesh.
    `chunk_tokens` sets the tokens per chunk of mode chunked (default: CHUNK_BYTES of fp32 logits)."""
    count = (targets != ignore_index).sum()
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if mode == "plain":
        whole = weight.full_tensor() if is_dtensor(weight) else weight
        return summed_cross_entropy(nn.functional.linear(hidden, whole), targets, ignore_index)[0], count
    if mode == "fused":
        return _liger_loss(hidden, weight, targets, ignore_index), count
    if mode != "chunked":
        raise UsageError(f"Unknown loss {mode!r}; choose one of {', '.join(MODES)}.")
    local, group, offset = vocabulary_slice(weight)
    chunk = chunk_tokens or max(1, CHUNK_BYTES // (4 * local.shape[0]))
    grad_on = torch.is_grad_enabled()
    wanted = (grad_on and hidden.requires_grad, grad_on and local.requires_grad)
    loss = _ChunkedLinearCrossEntropy.apply(hidden, local, targets, chunk, group, offset, ignore_index, wanted)
    return loss, count


def vocabulary_slice(weight: torch.Tensor) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """(this process's rows of the head's weight, as a tensor autograd follows back to `weight`; the process group
    that holds the other rows, or None; the vocabulary index of its first row)."""
    if not is_dtensor(weight):
        return weight, None, 0
    from torch.distributed.tensor import Replicate, Shard  # imported already: `weight` is a DTensor

    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return weight.to_local(), None, 0
    if mesh.mesh_dim_names == (TENSOR_DIM,) and placements == (Shard(0),):
        rows = math.ceil(weight.shape[0] / mesh.size())  # DTensor splits rows as torch.chunk does
        return weight.to_local(), mesh.get_group(), mesh.get_local_rank() * rows
    raise UsageError(
        f"The output head's weight is laid out as {placements} over the mesh {mesh.mesh_dim_names}; the chunked "
        "loss takes it whole or split by vocabulary over the tp mesh: build the loss with engine.lm_loss(head) after "
        "engine.setup, so that the FSDP unit holding the head keeps it gathered after forward."
    )


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The summed loss of hidden [N, features] through weight [V (this process's rows), features]; its forward
    keeps the gradients with respect to the inputs that need one, and its backward scales them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        group: dist.ProcessGroup | None,
        offset: int,
        ignore_index: int,
        wanted: tuple[bool, bool],
    ) -> torch.Tensor:
        compute = matmul_dtype(hidden, weight)
        head = weight.to(compute)
        grad_hidden = torch.empty_like(hidden) if wanted[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wanted[1] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            grad_rows = grad_hidden[rows] if grad_hidden is not None else None
            total += _chunk_loss(
                hidden[rows].to(compute), targets[rows], head, ignore_index, group, offset, grad_rows, grad_weight
            )
        if grad_hidden is not None and group is not None:
            dist.all_reduce(grad_hidden, group=group)  # the sum of every vocabulary slice's share
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        # In place: the kept gradients serve this one backward (a second one, with retain_graph, is refused by
        # autograd's check of the saved tensors' versions), and a copy would add a [V, features] tensor at the peak.
        grad_hidden, grad_weight = ctx.saved_tensors
        scaled_hidden = grad_hidden.mul_(grad_loss.to(grad_hidden.dtype)) if grad_hidden is not None else None
        scaled_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype) if grad_weight is not None else None
        return scaled_hidden, scaled_weight, None, None, None, None, None, None


def _chunk_loss(
    part: torch.Tensor,
    targets: torch.Tensor,
    head: torch.Tensor,
    ignore_index: int,
    group: dist.ProcessGroup | None,
    offset: int,
    grad_rows: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk's summed loss; its gradients written into `grad_rows` (its rows of the hidden states' gradient)
    and added to `grad_weight`, where given. Its logits are the only tensor of their size, freed on return."""
    logits = (part @ head.T).float()  # [chunk, V]
    lse, target_logit, column, hit = _softmax_in_place(logits, targets, group, offset)
    kept = targets != ignore_index
    if grad_rows is not None or grad_weight is not None:
        # d loss / d logits = softmax - one-hot(target) for the kept tokens, in place over the logits (every
        # temporary of their size would be a fresh allocation, and cost its page faults).
        slope = logits.scatter_add_(1, column, -hit.float()).mul_(kept[:, None]).to(part.dtype)
        if grad_rows is not None:
            grad_rows.copy_(slope @ head)
        if grad_weight is not None and part.dtype == torch.float32:
            grad_weight.addmm_(slope.T, part)  # no [V, features] temporary
        elif grad_weight is not None:
            grad_weight += slope.T @ part
    return ((lse - target_logit) * kept).sum()


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matrix product runs in, as inside the model: autocast's where it is on, else the
    weight's (FSDP's mixed precision hands the hidden states out in fp32 and keeps the gathered weight in bf16)."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return weight.dtype


def _softmax_in_place(
    logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None, offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turns a chunk's logits [chunk, V] into its softmax over the whole vocabulary, in place (no other tensor of
    their size is made), and returns (the log-sum-exp over the whole vocabulary and the target's logit, each
    [chunk]; the target's row among this process's rows of the head and whether it is one of them, each
    [chunk, 1]). With a vocabulary split over `group`, one all-reduce of every process's log-sum-exp (each in its
    own row) and of its target logits (zero where the target is another's) gives the first two."""
    local = targets - offset
    hit = ((local >= 0) & (local < logits.shape[1]))[:, None]
    column = local.clamp(0, logits.shape[1] - 1)[:, None]
    target_logit = (logits.gather(1, column) * hit)[:, 0]
    top = logits.amax(dim=1)
    exponentials = logits.sub_(top[:, None]).exp_()
    lse = top + exponentials.sum(dim=1).log()
    if group is not None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        shared = torch.zeros((size + 1, len(lse)), dtype=torch.float32, device=logits.device)
        shared[rank], shared[size] = lse, target_logit
        dist.all_reduce(shared, group=group)
        lse, target_logit = shared[:size].logsumexp(dim=0), shared[size]
    exponentials.mul_((top - lse).exp()[:, None])  # exp(logit - top) * exp(top - lse) = exp(logit - lse)
    return lse, target_logit, column, hit


def _liger_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Liger-Kernel's fused linear cross-entropy, summed (GPUs; check_runnable refuses it elsewhere first)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    if is_dtensor(weight):
        raise UsageError("loss fused takes the output head whole; use loss chunked under tensor parallelism.")
    fused = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction="sum")
    return fused(weight, hidden.contiguous(), targets.contiguous())


class TokenLoss:
    """A language model's loss_fn for engine.forward_backward and engine.forward_loss: (output, targets) -> (the
    summed cross-entropy, the number of targets), in `mode`. Plain takes the model's logits; chunked and fused take
    its hidden states before `head`, which the engine gets by making `head` hand its input through while the model
    runs (`hidden_states`), and compute the loss with `head`'s weight (chunked: `chunk_tokens` at a time).
    `holders`: the set-up model (and a pipeline's stages), where an FSDP unit that holds `head` is found."""

    def __init__(
        self,
        head: nn.Module,
        mode: str = "plain",
        ignore_index: int = IGNORE_INDEX,
        chunk_tokens: int | None = None,
        holders: Iterable[nn.Module] = (),
    ) -> None:
        weight = getattr(head, "weight", None)
        require(
            (mode in MODES, f"Unknown loss {mode!r}; choose one of {', '.join(MODES)}."),
            (
                mode == "plain" or (isinstance(weight, torch.Tensor) and weight.dim() == 2),
                f"The output head must be a Linear layer (a [vocabulary, features] weight), not "
                f"{type(head).__name__}; pass the layer that turns hidden states into logits.",
            ),
            (
                mode == "plain" or getattr(head, "bias", None) is None,
                "The output head has a bias, which the chunked and fused losses leave out; use loss plain.",
            ),
        )
        self.head, self.mode, self.ignore_index, self.chunk_tokens = head, mode, ignore_index, chunk_tokens
        if mode != "plain":
            keep_gathered(head, holders)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """The number of targets the loss counts in `targets` (those not ignore_index), without the model's output."""
        return (targets != self.ignore_index).sum()

    def __call__(self, output: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = getattr(output, "logits", output)  # a Hugging Face output's; under chunked, the hidden states
        if self.mode == "plain":
            return summed_cross_entropy(values, targets, self.ignore_index)
        return linear_cross_entropy(
            values,
            self.head.weight,
            targets,
            mode=self.mode,
            ignore_index=self.ignore_index,
            chunk_tokens=self.chunk_tokens,
        )

    @contextlib.contextmanager
    def hidden_states(self) -> Iterator[None]:
        """Inside it, under chunked and fused, `head` returns its input (its hooks still run: tensor parallelism
        gathers the positions sequence parallelism split), so the model's output is the hidden states."""
        if self.mode == "plain":
            yield
            return
        head = self.head
        own = head.__dict__.get("forward")
        head.forward = _hand_on
        try:
            yield
        finally:
            if own is None:
                del head.forward
            else:
                head.forward = own


def outputs_for(loss_fn: Any) -> contextlib.AbstractContextManager:
    """Where `loss_fn` is a TokenLoss, its `hidden_states`: inside it the model's output is what its mode takes."""
    return loss_fn.hidden_states() if isinstance(loss_fn, TokenLoss) else contextlib.nullcontext()


def _hand_on(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return hidden


def keep_gathered(head: nn.Module, holders: Iterable[nn.Module]) -> None:
    """Makes the innermost FSDP unit under `holders` that holds `head` keep its gathered parameters from forward
    until backward, as zero2 does (zero3 frees them after forward), since the loss uses the head's weight after the
    model's forward. For a model's root unit it costs nothing: its backward begins with the loss and gathers them
    again at once otherwise (FSDP2 itself keeps a root gathered unless told to free it, as zero3 tells it)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for holder in holders for m in holder.modules() if isinstance(m, FSDPModule)]
    owners = [unit for unit in units if any(module is head for module in unit.modules())]
    if owners:
        innermost = min(owners, key=lambda unit: sum(1 for _ in unit.modules()))
        innermost.set_reshard_after_forward(False, recurse=False)


def check_runnable(
    loss: str,
    liger: bool,
    device: torch.device,
    head_kept: bool,
    vocabulary_split: bool,
    find_unused_parameters: bool = False,
) -> None:
    """Refuses, in one sentence, a loss or Liger-Kernel setting this device or layout cannot run; `head_kept`:
    whether the strategy keeps the output head's weight after forward (composes with the table's head_after_forward,
    strategies/compatibility.py); `vocabulary_split`: whether tensor parallelism splits the output head."""
    require(
        (
            device.type == "cuda" or (loss != "fused" and not liger),
            "loss fused and liger run Liger-Kernel's Triton kernels, which need a CUDA GPU; use loss chunked on CPU "
            "(--loss chunked) and drop liger.",
        ),
        (
            loss != "fused" or not vocabulary_split,
            "loss fused needs the output head whole in each process and tp_size splits it by vocabulary; use loss "
            "chunked under tensor parallelism.",
        ),
        (
            loss == "plain" or head_kept,
            f"loss {loss} uses the output head's weight after the model's forward, where DeepSpeed's ZeRO-3 has "
            "released it; use loss plain under strategy deepspeed, or strategy zero2 or zero3.",
        ),
        (
            loss == "plain" or not find_unused_parameters,
            f"loss {loss} uses the output head after the model's forward, which DDP's find_unused_parameters would "
            "count as unused; drop find_unused_parameters or use loss plain.",
        ),
    )
    if (loss == "fused" or liger) and importlib.util.find_spec("liger_kernel") is None:
        raise UsageError(
            "loss fused and liger need Liger-Kernel; pip install 'multigpu[gpu]' (Liger-Kernel), or use loss chunked."
        )


def apply_liger(model: nn.Module) -> None:
    """Replaces a Hugging Face decoder's RMSNorm, rotary embedding and SwiGLU MLP with Liger-Kernel's kernels, in
    place (the loss is the `loss` setting's); a model Liger-Kernel has no kernels for is refused."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    inner = model.base_model.model if hasattr(getattr(model, "base_model", None), "model") else model  # peft's
    kind = getattr(getattr(inner, "config", None), "model_type", None)
    if kind not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise UsageError(
            f"liger replaces the layers of Hugging Face decoders Liger-Kernel knows, and {type(inner).__name__} "
            f"(model_type {kind!r}) is not one of them; drop liger."
        )
    _apply_liger_kernel_to_instance(model=inner, cross_entropy=False, fused_linear_cross_entropy=False)
