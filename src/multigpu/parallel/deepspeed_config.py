"""The DeepSpeed config strategy deepspeed hands to deepspeed.initialize: the user's JSON file (--deepspeed-config),
read and checked, with the Engine's settings and the strategy's options applied.

The Engine keeps what it owns for every strategy (the accumulation boundaries, clipping's limit, the precision and
the batches), so a file that sets those is refused with the Engine's option to use instead.
"""

from __future__ import annotations

import functools
from typing import Any

from multigpu.config.flags import json_value, read_json
from multigpu.core.errors import UsageError, require

# Config keys the Engine sets, and the Engine option to use instead. "auto" (as in HF configs) always fits.
ENGINE_OWNED = {
    "gradient_accumulation_steps": "grad_accum_steps",
    "gradient_clipping": "max_grad_norm",
    "fp16": "precision",
    "bf16": "precision",
    "torch_autocast": "precision",
}
# DeepSpeed needs these for its own bookkeeping only; engine.dataloader's batch_size decides the batches.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu")


def completed_config(
    source: str | None,
    zero_stage: int | None,
    offload_optimizer: bool,
    offload_param: bool,
    max_grad_norm: float | None,
) -> dict[str, Any]:
    """The DeepSpeed config: the user's file `source`, if any, with the Engine's settings and the flags applied."""
    config = read_config(source)
    for key, option in ENGINE_OWNED.items():
        value = config.pop(key, "auto")
        if value != "auto" and not _disabled(value):
            raise UsageError(
                f"The DeepSpeed config sets {key!r}, which the Engine controls; remove it and set the Engine's "
                f"{option} instead."
            )
    for key in BATCH_KEYS:
        config.pop(key, None)
    zero = dict(config.get("zero_optimization", {}))
    stage = zero.get("stage", 2) if zero_stage is None else zero_stage
    if zero.get("stage", stage) != stage:
        raise UsageError(
            f"zero_stage {stage} contradicts the DeepSpeed config's stage {zero['stage']}; pass one of them."
        )
    require((stage in (1, 2, 3), f"strategy deepspeed runs ZeRO stage 1, 2 or 3, not {stage}; use ddp for 0."))
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        require((stage == 3, "offload_param needs ZeRO stage 3, where parameters are partitioned."))
        zero["offload_param"] = {"device": "cpu"}
    if "offload_optimizer" in zero:
        # The Engine's users bring a torch optimizer; DeepSpeed would insist on its compiled CPU Adam.
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.update(
        gradient_clipping=max_grad_norm or 0.0,
        gradient_accumulation_steps=1,  # the Engine marks each boundary itself
        train_micro_batch_size_per_gpu=1,
        zero_optimization={**zero, "stage": stage},
    )
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 2**62)  # the Engine reports progress itself
    return config


def read_config(source: str | None) -> dict[str, Any]:
    """The user's DeepSpeed config, with the keys multigpu reads or merges and the types DeepSpeed would otherwise
    trip over deep inside its engine checked; the rest of its schema is DeepSpeed's to check."""
    if source is None:
        return {}
    config = read_json(source, "pass the path of a DeepSpeed JSON config", "--deepspeed-config", "a DeepSpeed config")
    get = functools.partial(json_value, file=source, optional=True, advice="fix the DeepSpeed config")
    get(config, None, dict)
    auto = ("auto",)  # as in Hugging Face's configs: the integration fills it in
    for key in (*BATCH_KEYS, "gradient_accumulation_steps"):
        get(config, key, (int, str), minimum=1, choices=auto)
    get(config, "gradient_clipping", (float, str), minimum=0, choices=auto)
    for key in ("fp16", "bf16"):
        if isinstance(get(config, key, (dict, str), choices=auto), dict):
            get(config, f"{key}.enabled", (bool, str), choices=auto)
    if get(config, "zero_optimization", dict) is not None:
        get(config, "zero_optimization.stage", int, minimum=0, maximum=3)
        for key in ("offload_optimizer", "offload_param"):
            get(config, f"zero_optimization.{key}", dict)
    get(config, "optimizer", dict)
    return config


def _disabled(section: Any) -> bool:
    return isinstance(section, dict) and not section.get("enabled", False)
