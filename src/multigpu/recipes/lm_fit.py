"""What a finetune's flags ask of a causal language model that its config.json already answers, refused in the CLI's
process before any worker loads the model: pipeline stages against its layers, a tp degree (and a Ulysses cp degree)
against its attention heads, --seq-len against its positions, one micro-batch against the memory of this machine's
device. The workers' own checks (parallel/pipeline_stages.py, strategies/tp.py) ask the same functions of the model they
build."""

from __future__ import annotations

import os
from typing import Any

import torch

from multigpu.config.layout import ParallelDims, check_tp_heads
from multigpu.config.pipeline import check_microbatches, check_schedule, stage_layers
from multigpu.core.errors import UsageError
from multigpu.models.lm_models import model_dir
from multigpu.parallel.context import check_heads
from multigpu.planner.memory import activations_per_gpu
from multigpu.planner.plan_config import PlanConfig
from multigpu.planner.shapes import load_shape


def check_fits(config: Any, layout: ParallelDims) -> None:
    """Refuses what `config` (a FinetuneConfig) asks of its --model that the model's config says it cannot do, under
    the `layout` the workers would resolve."""
    from transformers import AutoConfig

    directory = model_dir(config.model)
    described = AutoConfig.from_pretrained(directory)
    layers = getattr(described, "num_hidden_layers", None)
    if layout.pp > 1:
        per_rank = check_schedule(config.pp_schedule, config.pp_stages_per_rank)
        if isinstance(layers, int):
            stage_layers(layers, layout.pp * per_rank, config.pp_split, config.pp_schedule)
        # Each pipeline splits its batch_size rows (even batch shares) into micro-batches.
        check_microbatches(config.pp_schedule, layout.pp, per_rank, config.pp_microbatches, config.batch_size)
    if layout.tp > 1:
        check_tp_heads(described, layout.tp)
    if layout.cp > 1 and config.cp_method == "ulysses":
        check_heads(described.num_attention_heads, layout.cp)
    positions = getattr(described, "max_position_embeddings", None)
    if isinstance(positions, int) and config.seq_len > positions:
        raise UsageError(
            f"--seq-len {config.seq_len} is longer than the {positions} positions --model {config.model} has "
            f"(max_position_embeddings in its config.json); pass a --seq-len of {positions} or less."
        )
    check_batch(config, layout, directory)


def check_batch(config: Any, layout: ParallelDims, directory: Any) -> None:
    """Refuses a --batch-size whose one micro-batch's activations alone, as the planner counts them, exceed the memory
    of this machine's device (a GPU's, or the RAM a CPU run uses): such a run can only die of out-of-memory once the
    workers have loaded the model. A batch that fits is left alone, however large: the user may mean it."""
    try:
        shape = load_shape(str(directory))
    except UsageError:  # the planner counts Llama-style configs only; a model it cannot count is not refused here
        return
    plan = PlanConfig(
        batch_size=config.batch_size,
        seq_len=config.seq_len,
        precision=config.precision,
        activation_checkpointing=config.activation_checkpointing,
    )
    needed = activations_per_gpu(shape, plan, config.batch_size, layout.cp) / max(1, layout.tp)
    device, memory = device_memory()
    if needed > memory:
        raise UsageError(
            f"--batch-size {config.batch_size} at --seq-len {config.seq_len} needs about {needed / 2**30:,.0f} GiB of "
            f"activations per process for --model {config.model}, as the planner counts them, more than this "
            f"machine's {device} holds ({memory / 2**30:,.0f} GiB); pass a smaller --batch-size (and "
            "--grad-accum-steps for a larger batch per step)."
        )


def device_memory() -> tuple[str, float]:
    """(what the workers train on, its memory in bytes): the first GPU's, or this machine's RAM without one."""
    if torch.cuda.is_available():
        return "GPU", float(torch.cuda.get_device_properties(0).total_memory)
    return "RAM", float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
