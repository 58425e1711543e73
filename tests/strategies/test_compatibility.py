"""The table of what composes (strategies/compatibility.py): each rule refuses with its one sentence as the Engine's
settings are checked, before any worker starts; each strategy's composes_with names only the table's features; and
docs/strategies.md holds the table as `render()` writes it."""

from __future__ import annotations

import pytest

from multigpu.core.errors import UsageError
from multigpu.engine.config import EngineConfig
from multigpu.strategies import STRATEGY_CLASSES, strategy_class
from multigpu.strategies.compatibility import DOC, END, FEATURE_NAMES, START, composes, render, rendered_into


def test_the_doc_holds_the_table_as_rendered() -> None:
    written = DOC.read_text()
    assert START in written and END in written
    assert written == rendered_into(written), (
        "docs/strategies.md's compatibility table differs; run `python -m multigpu.strategies.compatibility`"
    )
    assert "| `deepspeed` |" in render()


@pytest.mark.parametrize("name", list(STRATEGY_CLASSES))
def test_every_strategy_names_only_features_of_the_table(name: str) -> None:
    assert strategy_class(name).composes_with <= FEATURE_NAMES


def test_a_feature_not_in_the_table_is_no_fact_to_ask_about() -> None:
    with pytest.raises(KeyError, match="no feature"):
        composes(strategy_class("ddp"), "telepathy")


@pytest.mark.parametrize(
    ("settings", "sentence"),
    [
        (
            {"strategy": "deepspeed", "optimizer": "adamw-4bit"},
            "Strategy deepspeed steps its optimizer over flat partitions of many parameters, which optimizer "
            "adamw-4bit cannot update; use zero2 or zero3 with it, or adamw under deepspeed.",
        ),
        (
            {"strategy": "deepspeed", "precision": "bf16-true"},
            "DeepSpeed keeps fp32 master weights, so it has no bf16-true; use precision bf16-mixed.",
        ),
        (
            {"strategy": "pp", "precision": "fp16-mixed"},
            "fp16-mixed's loss scaling needs every pipeline stage to see the loss, which only the last one computes; "
            "use bf16-mixed or 32 under strategy pp.",
        ),
        (  # beside pp_size, the pipeline the strategy runs inside refuses it too
            {"strategy": "zero3", "pp_size": 2, "precision": "fp16-mixed"},
            "fp16-mixed's loss scaling needs every pipeline stage to see the loss",
        ),
        (
            {"strategy": "hsdp", "grad_compression": "powersgd:2"},
            "grad_compression powersgd runs as a DDP communication hook and hsdp reduces through FSDP2, which has "
            "none; use bf16 or fp16 with it, or powersgd with strategy ddp or zero1.",
        ),
        (  # the strategy's own name, where an alias named it
            {"strategy": "fsdp", "pp_size": 2, "cpu_offload": True},
            "pp_size runs pipeline stages with zero2, zero3 or hsdp inside them (or whole replicas with strategy pp), "
            "not zero3 with cpu_offload or unsharded_grad_accum; drop those or pp_size.",
        ),
        (
            {"global_batch_size": 64, "grad_accum_steps": 2},
            "global_batch_size derives grad_accum_steps from the number of processes; give one of the two, not both "
            "(got grad_accum_steps 2).",
        ),
        (
            {"compile_backend": "aot_eager"},
            "compile_backend aot_eager is torch.compile's; add compile (--compile) or drop it.",
        ),
        (
            {"strategy": "deepspeed", "offload_param": True, "zero_stage": 2},
            "offload_param needs ZeRO stage 3, where parameters are partitioned; set zero_stage 3.",
        ),
        (
            {"strategy": "zero3", "cpu_offload": True, "optimizer": "muon"},
            "optimizer muon gathers each matrix's update across ranks, which zero3's cpu_offload keeps in host "
            "memory; drop cpu_offload, or use adamw or a low-bit adamw with it.",
        ),
    ],
)
def test_each_rule_refuses_with_its_sentence(settings: dict, sentence: str) -> None:
    with pytest.raises(UsageError) as refused:
        EngineConfig(**settings)
    assert str(refused.value).startswith(sentence)


@pytest.mark.parametrize(
    "settings",
    [
        {"strategy": "ddp", "grad_compression": "powersgd", "precision": "fp16-mixed", "optimizer": "muon"},
        {"strategy": "zero3", "precision": "bf16-true", "optimizer": "adamw-8bit"},
        {"strategy": "auto", "precision": "fp16-mixed"},  # auto chooses among what runs it
        {"strategy": "tp", "grad_compression": "powersgd"},  # not tp's option: the registry says so, not the table
        {"global_batch_size": 64, "compile": True, "compile_backend": "aot_eager"},
    ],
)
def test_what_composes_passes(settings: dict) -> None:
    EngineConfig(**settings)
