"""`multigpu export` of a lora or qlora finetune's checkpoint: the peft adapter directory its run writes at its end."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from multigpu import checkpoint as checkpoints
from multigpu.config.config_writer import RUN_CONFIG
from multigpu.core.atomic import write_dir
from multigpu.core.errors import UsageError
from multigpu.models import lm_models
from multigpu.recipes.common import EXPORT_RESULT, check_new_output, run_record
from multigpu.recipes.finetune import FinetuneConfig
from multigpu.recipes.lm_results import save_pretrained


def holds_adapter(checkpoint: Path, key: str = "model") -> bool:
    """Whether a checkpoint's model is a peft LoRA model: a lora or qlora finetune's."""
    return any(".lora_A." in name for name in checkpoints.model_metadata(checkpoint, key))


def export_adapter(checkpoint: Path, out: Path, key: str = "model") -> None:
    """`multigpu export` of a lora or qlora finetune's checkpoint: the peft adapter directory the finetune writes
    at its end (SAVE_DIR/adapter), for that checkpoint's step. peft writes it, from the adapted model built as the
    finetune builds it (on the meta device: no weights read), so its tensors have the names peft and
    transformers load and adapter_config.json the run's settings, read from the run's config.yaml."""
    if out.suffix == ".safetensors":
        raise UsageError(
            f"{checkpoint} holds a LoRA adapter, which peft loads from a directory; pass a directory name as OUT, "
            f"such as {out.with_suffix('')}, for adapter_model.safetensors and adapter_config.json."
        )
    check_new_output(out, "OUT")
    run = finetune_of(checkpoint)
    with torch.device("meta"):
        model = lm_models.load_model(
            run.model, "lora", run.lora_r, run.lora_alpha, lora_experts=run.lora_experts, skeleton=True
        )
    stored = checkpoints.model_metadata(checkpoint, key)
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and (name not in stored or list(stored[name].size) != list(parameter.shape)):
            found = f"is {list(stored[name].size)}" if name in stored else "is missing"
            raise UsageError(
                f"{name} {found} in {checkpoint} but {list(parameter.shape)} in a --lora-r {run.lora_r} adapter "
                f"of --model {run.model}, as its run's config.yaml gives them; export a checkpoint of that run."
            )
    state = checkpoints.full_model_state(checkpoint, key, [n for n, p in model.named_parameters() if p.requires_grad])
    tokenizer = lm_models.load_tokenizer(run.model)
    write_dir(out, functools.partial(save_pretrained, model, tokenizer, state=state), EXPORT_RESULT)
    print(
        f"wrote the LoRA adapter of {checkpoint} ({len(state)} tensors) to {out}; apply it with "
        f"`multigpu generate --model {run.model} --adapter {out}` or peft's PeftModel.from_pretrained"
    )


def finetune_of(checkpoint: Path) -> FinetuneConfig:
    """The settings of the finetune that wrote `checkpoint` (SAVE_DIR/checkpoints/step-N): its SAVE_DIR/config.yaml."""
    settings = run_record(checkpoint.absolute())
    if not settings:
        raise UsageError(
            f"{checkpoint} holds a LoRA adapter, whose --model, --lora-r and --lora-alpha export reads from its "
            f"run's {RUN_CONFIG}, and {checkpoint.absolute().parent.parent / RUN_CONFIG} does not exist; export the "
            "checkpoint where its finetune wrote it, or use the adapter the finetune wrote at its end "
            "(SAVE_DIR/adapter)."
        )
    return FinetuneConfig(
        **{name: settings[name] for name in ("model", "lora_r", "lora_alpha", "lora_experts") if name in settings}
    )
