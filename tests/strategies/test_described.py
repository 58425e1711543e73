"""A strategy describes itself (strategies/facts.py): one registered from a file of its own (own_strategy.py) is
planned, simulated and benched from its facts, and refused where they say it cannot run."""

from __future__ import annotations

import dataclasses
import re

import pytest

from multigpu.cli import main
from multigpu.config.layout import ParallelDims
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.engine.start import check_shared_gpus
from multigpu.planner import plan
from multigpu.planner.simulate import SimulateConfig, simulate
from multigpu.strategies import STRATEGY_CLASSES
from multigpu.tools.bench import BenchConfig, cell_list, reducing
from tests.strategies.own_strategy import Own


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(STRATEGY_CLASSES, "own", "tests.strategies.own_strategy:Own")


@pytest.mark.usefixtures("registered")
def test_the_planner_shows_it_with_the_memory_its_facts_give(capsys: pytest.CaptureFixture) -> None:
    rows = {m.strategy: m for m in plan("llama-3.1-8b", gpus=8).strategies}
    assert list(rows)[:3] == ["ddp", "own", "zero1"]  # fastest first, by its row's order
    own, zero1 = rows["own"], rows["zero1"]  # the same states sharded, the same buffers
    assert (own.params, own.grads, own.optimizer, own.temporary) == (
        zero1.params,
        zero1.grads,
        zero1.optimizer,
        zero1.temporary,
    )
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8"]) == 0
    assert re.search(r"^│ +own │", capsys.readouterr().out, re.M)  # a row of the table


@pytest.mark.usefixtures("registered")
def test_the_simulator_models_its_collectives() -> None:
    config = SimulateConfig(params=1_000_000_000, compute_s=0.5, units_per_step=8, gpus=(1, 2, 8, 16))
    own = simulate(dataclasses.replace(config, strategy="own"))
    zero1 = simulate(dataclasses.replace(config, strategy="zero1"))  # all-reduce, then the shards gathered
    assert [p.exposed_comm_s for p in own] == [p.exposed_comm_s for p in zero1]
    assert own[-1].exposed_comm_s > 0


@pytest.mark.usefixtures("registered")
def test_bench_takes_it_with_each_compression() -> None:
    config = BenchConfig(strategies="ddp,own", nproc="1,2", grad_compressions="none,bf16")
    config.check()
    assert reducing("own")
    assert (2, "own", "bf16") in cell_list(config)


@pytest.mark.usefixtures("registered")
def test_it_refuses_shared_gpus_as_its_facts_say(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DistEnv, "shares_gpus", property(lambda self: True))
    env = DistEnv(world_size=2, local_world_size=2)
    with pytest.raises(UsageError, match=r"^2 processes sharing .* and strategy own needs them; share GPUs under"):
        check_shared_gpus(Own(layout=ParallelDims(replicate=2)), env)
