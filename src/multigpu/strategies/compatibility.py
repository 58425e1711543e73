"""What composes: the one table of refusals of settings that cannot go together, known from the settings alone, each
rule with the one sentence it raises. `check_settings` runs the whole table as EngineConfig is checked
(engine/config.py), so the CLI, config files and the Engine refuse alike, before any worker starts.

Two kinds of rule. A FEATURE is something a run turns on (an optimizer, a precision, a compression) that some
strategies cannot run: each strategy class names the features it runs with (`Strategy.composes_with`), and the table
refuses the others, never naming strategies. A PAIR is two settings that cannot go together under any strategy. The
degrees a strategy runs beside (tp, pp, cp, ep, replicate) are `spread.takes`, refused by the registry
(strategies/__init__.py). What needs the model or the machine (the device, the GPUs, installed packages, the model's
layers) is refused where that is known: the features without a sentence here (`at_start`) by engine/start.py, from
the same facts.

docs/strategies.md's compatibility section is `render()`'s text (`python -m multigpu.strategies.compatibility`
rewrites it; tests/strategies/test_compatibility.py fails while they differ).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from multigpu.config.optimizer import LOW_BIT, NOT_WITH_CPU_OFFLOAD
from multigpu.core.errors import UsageError
from multigpu.parallel.compression import Compression, powersgd_refusal
from multigpu.strategies import STRATEGY_CLASSES, strategy_class
from multigpu.strategies.base import Strategy


@dataclass(frozen=True)
class Feature:
    """A feature some strategies cannot run: whether `settings` use it, and the sentence refusing it under a strategy
    named `name`; None: engine/start.py refuses it in its own words, where the machine (dp runs as single on one
    GPU) and auto's choice are known, from the same fact. `option`: the strategy option it is a value of; a strategy
    that does not take the option is told so by the registry instead."""

    name: str
    what: str  # the settings that turn it on, as the doc shows them
    uses: Callable[[Any], bool]
    sentence: Callable[[Any, str], str] | None = None
    option: str | None = None

    @property
    def at_start(self) -> bool:
        return self.sentence is None


@dataclass(frozen=True)
class Pair:
    """Two settings that cannot go together: `refuses(settings)` is True where they are given together."""

    name: str
    refuses: Callable[[Any], bool]
    sentence: Callable[[Any], str]


def _optimizer_under_flat_partitions(settings: Any, name: str) -> str:
    return (
        f"Strategy {name} steps its optimizer over flat partitions of many parameters, which optimizer "
        f"{settings.optimizer} cannot update; use zero2 or zero3 with it, or adamw under deepspeed."
    )


def _inside_pipeline(settings: Any, name: str) -> str:
    return (
        f"pp_size runs pipeline stages with zero2, zero3 or hsdp inside them (or whole replicas with strategy pp), not "
        f"{name} with cpu_offload or unsharded_grad_accum; drop those or pp_size."
    )


FEATURES: tuple[Feature, ...] = (
    Feature("muon", "optimizer muon", lambda s: s.optimizer == "muon", _optimizer_under_flat_partitions),
    Feature(
        "low_bit_optimizer",
        f"optimizer {', '.join(LOW_BIT)}",
        lambda s: s.optimizer in LOW_BIT,
        _optimizer_under_flat_partitions,
    ),
    Feature(
        "fp16",
        "precision fp16-mixed",
        lambda s: s.precision == "fp16-mixed",
        lambda s, name: (
            "fp16-mixed's loss scaling needs every pipeline stage to see the loss, which only the last "
            "one computes; use bf16-mixed or 32 under strategy pp."
        ),
    ),
    Feature(
        "bf16_true",
        "precision bf16-true",
        lambda s: s.precision == "bf16-true",
        lambda s, name: "DeepSpeed keeps fp32 master weights, so it has no bf16-true; use precision bf16-mixed.",
    ),
    Feature(
        "powersgd",
        "grad_compression powersgd[:RANK]",
        lambda s: Compression.parse(s.grad_compression).kind == "powersgd",
        lambda s, name: powersgd_refusal(name),
        option="grad_compression",
    ),
    Feature("cpu_offload", "cpu_offload", lambda s: s.cpu_offload, _inside_pipeline, option="cpu_offload"),
    Feature(
        "unsharded_grad_accum",
        "unsharded_grad_accum",
        lambda s: s.unsharded_grad_accum,
        _inside_pipeline,
        option="unsharded_grad_accum",
    ),
    Feature(  # at start: strategy auto may resolve to deepspeed there
        "head_after_forward",
        "loss chunked or fused",
        lambda s: s.loss != "plain",
    ),
    Feature("compile", "compile", lambda s: s.compile),
    Feature(
        "activation_checkpointing",
        "activation_checkpointing other than none",
        lambda s: s.activation_checkpointing != "none",
    ),
    Feature("sync_batchnorm", "sync_batchnorm", lambda s: s.sync_batchnorm),
    Feature("shared_gpus", "--share-gpus (processes sharing GPUs)", lambda s: False),
    Feature(
        "fault_tolerance",
        "fault_tolerance",
        lambda s: s.fault_tolerance,
        lambda s, name: (
            f"Fault tolerance averages replica groups of ddp, zero2, zero3, hsdp or single, whose gradients and "
            f"states every group holds alike; strategy {name} is not one of them: use one of those."
        ),
    ),
)
FEATURE_NAMES = frozenset(feature.name for feature in FEATURES)


def _in_the_way_of_replicas(s: Any) -> list[str]:
    """What a fault-tolerant run does not carry yet (not measured): a layout that splits the model inside a group,
    states of the step that healing does not copy (loss scale, PowerSGD's error, low-bit tensors), and gradients on
    the CPU."""
    sizes = [f"--{name.replace('_', '-')} {getattr(s, name)}" for name in ("tp_size", "pp_size", "cp_size", "ep_size")]
    return [size for size in sizes if not size.endswith((" None", " 1"))] + [
        setting
        for setting, used in (
            (f"--batch-shares {s.batch_shares}", s.batch_shares.strip() != "even"),
            ("--precision fp16-mixed", s.precision == "fp16-mixed"),
            ("--cpu-offload", s.cpu_offload is True),  # its gradients on the CPU, which NCCL across groups cannot take
            (f"--grad-compression {s.grad_compression}", s.grad_compression.startswith("powersgd")),
            (f"--optimizer {s.optimizer}", s.optimizer not in ("adamw", "sgd")),
        )
        if used
    ]


PAIRS: tuple[Pair, ...] = (
    Pair(
        "fault_tolerance x tp, pp, cp, ep, batch_shares, fp16, cpu_offload, powersgd, other optimizers",
        lambda s: s.fault_tolerance and bool(_in_the_way_of_replicas(s)),
        lambda s: (
            "Fault tolerance runs whole replicas (or FSDP shards) in each group with adamw or sgd, even batch shares, "
            "bf16 or fp32, gradients on the device and no PowerSGD; drop "
            f"{', '.join(_in_the_way_of_replicas(s))} or --fault-tolerance."
        ),
    ),
    Pair(
        "global_batch_size x grad_accum_steps",
        lambda s: s.global_batch_size is not None and s.grad_accum_steps != 1,
        lambda s: (
            "global_batch_size derives grad_accum_steps from the number of processes; give one of the two, "
            f"not both (got grad_accum_steps {s.grad_accum_steps})."
        ),
    ),
    Pair(
        "compile_backend x no compile",
        lambda s: not s.compile and s.compile_backend != "inductor",
        lambda s: f"compile_backend {s.compile_backend} is torch.compile's; add compile (--compile) or drop it.",
    ),
    Pair(
        "offload_param x zero_stage",
        lambda s: s.offload_param and s.zero_stage not in (None, 3),
        lambda s: "offload_param needs ZeRO stage 3, where parameters are partitioned; set zero_stage 3.",
    ),
    Pair(
        "cpu_offload x muon",
        lambda s: s.cpu_offload and s.optimizer in NOT_WITH_CPU_OFFLOAD,
        lambda s: (
            "optimizer muon gathers each matrix's update across ranks, which zero3's cpu_offload keeps in host "
            "memory; drop cpu_offload, or use adamw or a low-bit adamw with it."
        ),
    ),
)


def composes(strategy: type[Strategy] | Strategy, feature: str) -> bool:
    """Whether `strategy` runs with `feature` (a name of FEATURES)."""
    if feature not in FEATURE_NAMES:
        raise KeyError(f"{feature!r} is no feature of strategies/compatibility.py's table")
    return feature in strategy.composes_with


def takes_option(cls: type[Strategy], option: str) -> bool:
    """Whether strategy `cls` is built from the setting `option` (a field of an option group it inherits)."""
    return option not in cls.not_taken and any(f.name == option for f in fields(cls))


def check_settings(settings: Any) -> None:
    """Refuses, in the table's sentence, the first rule `settings` (an EngineConfig) break: the pairs, then each
    feature in use that the strategy named (and the pipeline it runs inside, beside pp_size) does not run with."""
    for pair in PAIRS:
        if pair.refuses(settings):
            raise UsageError(pair.sentence(settings))
    used = [f for f in FEATURES if not f.at_start and f.uses(settings)]
    if not used or settings.strategy not in STRATEGY_CLASSES:  # auto chooses a strategy that runs them
        return
    # Imported only here, where a feature some strategy refuses is in use: a run that uses none pays nothing.
    cls = strategy_class(settings.strategy)
    name = next(n for n, path in STRATEGY_CLASSES.items() if path == STRATEGY_CLASSES[settings.strategy])  # fsdp: zero3
    in_play = [cls]
    if (settings.pp_size or 1) > 1 and not cls.pipelined and "pp" in cls.spread.takes:
        in_play.append(strategy_class("pp"))  # the registry puts it inside a pipeline
    for feature in used:
        if feature.option is not None and not takes_option(cls, feature.option):
            continue  # the registry says the option is not this strategy's
        if feature.sentence is not None and not all(composes(each, feature.name) for each in in_play):
            raise UsageError(feature.sentence(settings, name))


def _unaliased() -> list[tuple[str, type[Strategy]]]:
    classes = [(name, strategy_class(name)) for name in STRATEGY_CLASSES]
    return list({cls: (name, cls) for name, cls in reversed(classes)}.values())[::-1]


def render() -> str:
    """The markdown of docs/strategies.md's compatibility section: strategy x feature, then the pairs' sentences."""
    features = [feature.name for feature in FEATURES]
    head = ["| strategy | " + " | ".join(f"`{name}`" for name in features) + " |", "| --- |" + " --- |" * len(features)]
    rows, beside = [], ""
    for name, cls in _unaliased():
        cells = []
        for feature in FEATURES:
            if feature.option is not None and not takes_option(cls, feature.option):
                cells.append("n/a")
            else:
                cells.append("yes" if composes(cls, feature.name) else "**no**")
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
        if cls.pipelined:  # its own options n/a, yet a strategy it holds beside pp_size is refused them too
            refused = ", ".join(f"`{f.name}`" for f in FEATURES if not composes(cls, f.name))
            beside = f"Beside pp_size, a strategy runs inside `{name}`'s pipeline, which refuses {refused} for it too."
    turned_on = ["| feature | turned on by | refused with |", "| --- | --- | --- |"]
    for feature in FEATURES:
        said = "at start (engine/start.py, where the machine and auto's choice are known)"
        if feature.sentence is not None:
            said = feature.sentence(_Shown(), "STRATEGY")
        turned_on.append(f"| `{feature.name}` | {feature.what} | {said} |")
    pairs = ["| settings | refused with |", "| --- | --- |"]
    pairs += [f"| {pair.name} | {pair.sentence(_Shown())} |" for pair in PAIRS]
    return "\n".join([*head, *rows, "", beside, "", *turned_on, "", *pairs]) + "\n"


class _Shown:
    """Stands for settings in the doc's sentences: each named setting reads as its name in capitals."""

    def __getattr__(self, name: str) -> str:
        return name.upper()


START, END = "<!-- compatibility:start -->", "<!-- compatibility:end -->"
DOC = Path(__file__).resolve().parents[3] / "docs" / "strategies.md"


def rendered_into(text: str) -> str:
    """`text` (docs/strategies.md) with what lies between its markers replaced by `render()`."""
    before, start, rest = text.partition(START)
    _, end, after = rest.partition(END)
    if not start or not end:
        raise ValueError(f"docs/strategies.md has no {START} ... {END} section")
    return f"{before}{START}\n{render()}{END}{after}"


if __name__ == "__main__":  # python -m multigpu.strategies.compatibility: rewrites docs/strategies.md's section
    DOC.write_text(rendered_into(DOC.read_text()))
    sys.exit(0)
