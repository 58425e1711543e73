"""What a finetune writes as its result: a peft adapter directory (lora, qlora) or an HF model directory (full), and
with --merge the base model with the adapter merged in; `multigpu export` writes an adapter the same way."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from multigpu.core.atomic import write_dir
from multigpu.engine.engine import Engine
from multigpu.models import lm_models
from multigpu.recipes.common import RUN_RESULT
from multigpu.transforms.pretrained import give_usual_mode


def save_result(config: Any, engine: Engine, model: nn.Module, tokenizer: Any) -> Path:
    """`config` (a FinetuneConfig: finetune imports this module) as a peft adapter directory (lora, qlora) or an HF
    model directory (full), from any strategy, and with --merge the merged model; each written whole or not at all
    (a full disk: one sentence, and a rerun writes it).

    The full state dict is gathered collectively (DTensors under zero3 become whole tensors on rank 0); peft's
    own save would read sharded storage and fail, or write an empty adapter.
    """
    out, *merged = outputs(config)
    state = engine.full_state_dict(model, trainable_only=config.method != "full")
    if engine.is_main_process:
        write_dir(out, functools.partial(save_pretrained, engine.unwrap(model), tokenizer, state=state), RUN_RESULT)
        if merged:
            from peft import PeftModel

            base = lm_models.load_model(config.model, "full")
            whole = PeftModel.from_pretrained(base, out).merge_and_unload()
            write_dir(merged[0], functools.partial(save_pretrained, whole, tokenizer), RUN_RESULT)
    engine.barrier()
    return out


def outputs(config: Any) -> list[Path]:
    """What a finetune writes as its result: its model (full) or adapter, then with --merge the merged model."""
    save_dir = Path(config.save_dir)
    return [save_dir / ("model" if config.method == "full" else "adapter")] + [save_dir / "merged"] * config.merge


def save_pretrained(model: Any, tokenizer: Any, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """`model` (its `state`, if given) and `tokenizer` as a directory transformers and peft load, readable by all."""
    with deepspeed_unimported():
        model.save_pretrained(directory, state_dict=state)
    tokenizer.save_pretrained(directory)
    give_usual_mode(directory.glob("*.safetensors"))


@contextlib.contextmanager
def deepspeed_unimported() -> Iterator[None]:
    """Where DeepSpeed was never imported, tells accelerate (which save_pretrained asks to unwrap the model) that it
    is not there: it imports DeepSpeed only to ask whether the model is a DeepSpeedEngine, which no model can be
    without that import. Saves 1.4-1.8 s of each writing process, and DeepSpeed's accelerator line."""
    import accelerate.utils.other as accelerate_other

    if "deepspeed" in sys.modules:
        yield
        return
    available = accelerate_other.is_deepspeed_available
    accelerate_other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        accelerate_other.is_deepspeed_available = available
