"""One definition per setting: every Engine setting is declared once in the package, and every config that shows it
declares a field that keeps that definition (config/settings.py: shown), its help, choices, type and checks."""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

import multigpu
from multigpu.config.settings import (
    SHOWS,
    Settings,
    TrainingSettings,
    override,
    override_group,
    setting,
    setting_names,
    shown,
    shown_group,
    shown_sources,
)
from multigpu.core.errors import UsageError
from multigpu.engine.config import EngineConfig, StrategyChoice
from multigpu.planner.plan_config import PlanConfig
from multigpu.recipes.finetune import FinetuneConfig
from multigpu.recipes.generate import GenerateConfig
from multigpu.recipes.train import TrainConfig
from multigpu.tools.bench import BenchConfig
from multigpu.tools.simulate_request import SimulateRequest
from multigpu.tools.verify import VerifyConfig

PACKAGE = Path(multigpu.__file__).parent


@functools.cache  # every source file parsed once: the tests below ask for it per config and per setting
def declared_fields() -> list[tuple[str, str, bool]]:
    """(name, where, is a setting) of every field declared in the body of a dataclass of the package: a setting
    carries a help text (`setting(...)`, or a field with metadata), a plain field is a value the class holds."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or not any("dataclass" in ast.dump(d) for d in node.decorator_list):
                continue
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                    value = ast.dump(statement.value) if statement.value is not None else ""
                    is_setting = "id='setting'" in value or "metadata" in value
                    where = f"{path.relative_to(PACKAGE)}:{node.name}"
                    found.append((statement.target.id, where, is_setting))
    return found


def test_every_engine_setting_is_declared_in_one_dataclass_only() -> None:
    """A setting is declared where its help text is written; a dataclass that only holds a value of the same name
    (a result's `strategy`, ParallelDims' resolved `replicate`, DeepSpeed's `max_grad_norm` argument) defines
    nothing, and a config that shows an Engine setting declares it `shown(...)` or `override(...)` (test below)."""
    names = setting_names(EngineConfig)
    declared: dict[str, list[str]] = {name: [] for name in names}
    for name, where, is_setting in declared_fields():
        if is_setting and name in declared:
            declared[name].append(where)
    assert {name: places for name, places in declared.items() if len(places) != 1} == {}


CONFIGS = (TrainConfig, FinetuneConfig, GenerateConfig, PlanConfig, VerifyConfig, BenchConfig, SimulateRequest)


def body_names(config: type) -> set[str]:
    """The fields written in the bodies of the package's dataclasses that `config` is or inherits."""
    bodies: dict[str, set[str]] = {}
    for name, where, _ in declared_fields():
        bodies.setdefault(where, set()).add(name)
    declared = set()
    for cls in config.__mro__:
        module = cls.__module__.removeprefix("multigpu.").replace(".", "/")
        declared |= bodies.get(f"{module}.py:{cls.__name__}", set())
        declared |= bodies.get(f"{module}/__init__.py:{cls.__name__}", set())
    return declared


@pytest.mark.parametrize("config", [EngineConfig, *CONFIGS], ids=lambda config: config.__name__)
def test_every_field_of_a_config_is_declared_in_a_class_body(config: type) -> None:
    """What a reader finds by searching `multi_gpu:`: every field is written in the body of a dataclass of the
    package that the config is or inherits, or, taken whole with its group (shown_group), in its source's; none is
    made at run time from nothing."""
    fields = {field.name: field for field in dataclasses.fields(config)}
    left = set(setting_names(config)) - body_names(config)
    from_groups = {name for name in left if SHOWS in fields[name].metadata}
    assert left - from_groups == set()
    for name in from_groups:
        shows = fields[name].metadata[SHOWS]
        assert shows.name == name and name in body_names(shows.source), name


@pytest.mark.parametrize("config", CONFIGS, ids=lambda config: config.__name__)
def test_shown_settings_keep_their_definition(config: type) -> None:
    """A config that shows an Engine setting shows the Engine's: the same type (None added for an override), choices
    and help (a note added, and what an unset value means here in place of the source's "(default: ...)")."""
    engine = {field.name: field for field in dataclasses.fields(EngineConfig)}
    fields = {field.name: field for field in dataclasses.fields(config)}
    hints = typing.get_type_hints(config)
    assert shown_sources(config)
    for source, names in shown_sources(config).items():
        source_hints = typing.get_type_hints(source)
        for ours, theirs in names.items():
            field = fields[ours]
            original = next(f for f in dataclasses.fields(source) if f.name == theirs)
            said_once = original.metadata["help"].split(" (default:")[0]
            assert field.metadata["help"].startswith(said_once), ours
            chosen = original.metadata.get("choices")
            assert chosen is None or set(field.metadata["choices"]) <= set(chosen), ours
            override = field.metadata[SHOWS].override
            assert hints[ours] == (source_hints[theirs] | None if override else source_hints[theirs]), ours
            if source is EngineConfig:
                assert original is engine[theirs]


def test_a_renamed_setting_keeps_its_name_for_its_source() -> None:
    """train's --multi-gpu is the Engine's strategy: --strategy is a name of it too, and the Engine gets it as
    strategy (with the run's save_dir as its log_dir)."""
    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == "multi_gpu")
    assert field.metadata["aliases"] == ("strategy",)
    engine = TrainConfig(multi_gpu="zero3", save_dir="runs/a").values_for(EngineConfig)
    assert engine["strategy"] == "zero3" and engine["log_dir"] == "runs/a" and "multi_gpu" not in engine


def test_a_shown_setting_is_checked_by_its_definition() -> None:
    with pytest.raises(UsageError, match=r"^grad_accum_steps must be 1 or more \(got 0\)\.$"):
        TrainConfig(grad_accum_steps=0)
    with pytest.raises(UsageError, match=r"^seed must be from 0 to 2\*\*32 - 1"):
        GenerateConfig(prompts="p.jsonl", out="o.jsonl", seed=-1)
    with pytest.raises(UsageError, match=r"^tp_size must be 1 or more \(got 0\)"):
        VerifyConfig(strategy="zero3", tp_size=0)
    # A renamed setting is named as the verb names it: simulate's --microbatches is the Engine's pp_microbatches.
    with pytest.raises(UsageError, match=r"^microbatches must be 1 or more \(got 0\)\.$"):
        SimulateRequest(microbatches=0)
    # An override left unset keeps the script's own: no check runs on it.
    assert VerifyConfig().values_for(EngineConfig) == {}


def test_a_shown_setting_its_source_lacks_or_types_otherwise_is_refused_at_import() -> None:
    with pytest.raises(TypeError, match=r"EngineConfig has no setting 'tp'"):

        @dataclass
        class NoSuchSetting(Settings):
            tp: int | None = shown(EngineConfig)

    with pytest.raises(TypeError, match=r"\('ring',\) are not choices of strategy"):

        @dataclass
        class OtherChoices(Settings):
            strategy: str = shown(EngineConfig, choices=("ring",))

    with pytest.raises(TypeError, match=r"precision is declared <class 'int'>, but precision's type is <class 'str'>"):

        @dataclass
        class OtherType(Settings):
            precision: int = shown(EngineConfig)

    with pytest.raises(TypeError, match=r"compile is declared <class 'bool'>, but compile's type is bool \| None"):

        @dataclass
        class OverrideWithoutNone(Settings):
            compile: bool = override(EngineConfig)


def test_a_group_shows_its_settings_in_its_order_and_those_declared_otherwise_as_declared() -> None:
    """A group's settings take its place in the body, in the source's order (or the order named); one the config
    declares itself (another default, name) keeps its declaration in the group's order; `omit` leaves some out."""

    @dataclass
    class Shows(Settings):
        before: int = setting(0, "a setting of its own")
        multi_gpu: str = shown(EngineConfig, "strategy")
        grad_accum_steps: int = shown(EngineConfig, default=2)
        _training = shown_group(EngineConfig, StrategyChoice, TrainingSettings, omit=("global_batch_size",))
        _overrides = override_group(EngineConfig, "tp_size", "cp_method", note="; here")
        after: int = setting(0, "another")

    order = ["before", "multi_gpu", "precision", "grad_accum_steps", "max_grad_norm", "seed", "tp_size", "cp_method"]
    assert setting_names(Shows) == (*order, "after")
    assert not hasattr(Shows, "_training") and Shows().values_for(EngineConfig)["grad_accum_steps"] == 2
    tp_size = next(f for f in dataclasses.fields(Shows) if f.name == "tp_size")
    assert tp_size.default is None and tp_size.metadata[SHOWS].override and tp_size.metadata["help"].endswith("; here")
    assert typing.get_type_hints(Shows)["cp_method"] == str | None
    with pytest.raises(UsageError, match=r"^Unknown cp_method 'mesh'"):
        Shows(cp_method="mesh")


def test_a_group_naming_what_its_source_lacks_or_hiding_a_field_is_refused_at_import() -> None:
    with pytest.raises(TypeError, match=r"EngineConfig has no setting\(s\) tp$"):

        @dataclass
        class NoSuchSetting(Settings):
            _layout = shown_group(EngineConfig, "tp")

    with pytest.raises(TypeError, match=r"Clash: seed declared otherwise too; omit it from the group"):

        @dataclass
        class Clash(Settings):
            seed: int = setting(1, "a seed of its own")
            _training = shown_group(EngineConfig, TrainingSettings)


@pytest.mark.parametrize(
    ("config", "name", "value"),
    [(TrainConfig, "mode", "lstm"), (FinetuneConfig, "method", "dora"), (PlanConfig, "optimizer", "lion")],
)
def test_a_value_outside_a_settings_choices_is_refused_where_the_config_is_built(
    config: type, name: str, value: str
) -> None:
    """The choices a setting declares are its check, for a config built in code or read from a file alike."""
    with pytest.raises(UsageError, match=rf"^Unknown {name} '{value}'; choose one of .+\.$"):
        config(**{name: value})
