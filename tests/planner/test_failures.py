"""planner/failures.py's goodput under failures against hand-computed cases, and `multigpu simulate --mtbf-hours`."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest

from multigpu.core.errors import UsageError
from multigpu.planner.failures import (
    Failures,
    FailureSettings,
    failures_at,
    heal_s,
    in_place_goodput,
    restart_goodput,
    restart_interval_s,
    young_daly_interval_s,
)
from multigpu.tools import simulate_request
from multigpu.tools.simulate_request import SimulateRequest

HOUR = 3600.0
# 1,000 GPUs of 1,000 h each: the job fails once an hour. A step of 0.01 s keeps whole steps close to any interval.
JOB = Failures(gpus=1000, mtbf_s=1000 * HOUR, step_s=0.01, state_bytes=80e9, save_s=10.0, load_s=20.0)


def test_without_failures_only_the_checkpoints_cost_time() -> None:
    never = replace(JOB, mtbf_s=math.inf)
    assert restart_goodput(replace(never, interval_s=600.0)).goodput == pytest.approx(1 - 10 / 600)
    # In place saves hourly, or as rarely as the restart way where that is rarer.
    assert in_place_goodput(replace(never, interval_s=600.0)).goodput == pytest.approx(1 - 10 / 3600)
    assert in_place_goodput(replace(never, interval_s=7200.0)).goodput == pytest.approx(1 - 10 / 7200)
    # No interval given and no failure: nothing would ever read a save, so none is taken.
    assert restart_goodput(never).goodput == 1.0 and restart_goodput(never).interval_s == math.inf


def test_restart_from_checkpoint_by_hand() -> None:
    # Young/Daly: sqrt(2 x 10 s x 3,600 s) = 268.33 s; each failure: 15 detect + 60 restart + 20 load + 134.16.
    interval = math.sqrt(2 * 10 * HOUR)
    assert young_daly_interval_s(10.0, HOUR) == pytest.approx(268.328, abs=1e-3)
    assert restart_interval_s(JOB) == pytest.approx(interval, abs=JOB.step_s)
    result = restart_goodput(JOB)
    assert result.lost_per_failure_s == pytest.approx(15 + 60 + 20 + interval / 2, abs=JOB.step_s)
    assert result.goodput == pytest.approx(1 - 10 / interval - (95 + interval / 2) / HOUR, abs=1e-5)
    assert result.steps_between_saves == round((interval - 10) / 0.01)


def test_the_young_daly_interval_minimises_the_restart_ways_loss() -> None:
    best = restart_goodput(JOB)
    for factor in (0.25, 0.5, 0.9, 0.99, 1.01, 1.1, 2.0, 4.0):
        other = restart_goodput(replace(JOB, interval_s=best.interval_s * factor))
        assert other.goodput < best.goodput, factor


def test_in_place_by_hand() -> None:
    # A group of 8 heals 80 GB at 12.5 GB/s per GPU: 0.8 s. Each failure: the 5 s heartbeat, a step again, and the
    # group's 8/1000 of the throughput for its 60.8 s away.
    assert heal_s(JOB) == pytest.approx(0.8)
    result = in_place_goodput(JOB)
    lost = 5 + 0.01 + 60.8 * 8 / 1000
    assert result.lost_per_failure_s == pytest.approx(lost)
    assert result.interval_s == HOUR  # hourly: Young/Daly's 268 s is more often
    assert result.goodput == pytest.approx(1 - 10 / HOUR - lost / HOUR)


def test_in_place_needs_a_live_peer() -> None:
    assert in_place_goodput(replace(JOB, gpus=8)) is None
    assert in_place_goodput(replace(JOB, gpus=15)) is None
    assert in_place_goodput(replace(JOB, gpus=16)) is not None


@pytest.mark.parametrize("way", [restart_goodput, in_place_goodput], ids=["restart", "in_place"])
def test_goodput_falls_as_the_job_grows(way) -> None:
    counts = [16, 64, 256, 1024, 4096, 16384, 65536]
    goodputs = [way(replace(JOB, gpus=n)).goodput for n in counts]
    assert all(a > b for a, b in itertools.pairwise(goodputs)), goodputs


@pytest.mark.parametrize("detect_s", [5.0, 15.0, 600.0])
@pytest.mark.parametrize("restart_s", [1.0, 60.0, 600.0])
@pytest.mark.parametrize("gpus", [16, 1024, 16384])
def test_in_place_wins_where_a_restart_costs_more_than_the_detection(detect_s, restart_s, gpus) -> None:
    job = replace(JOB, gpus=gpus, detect_s=detect_s, restart_s=restart_s)
    assert in_place_goodput(job).goodput >= restart_goodput(job).goodput
    assert in_place_goodput(job).lost_per_failure_s < restart_goodput(job).lost_per_failure_s


def test_in_place_loses_where_its_wait_costs_more_than_a_whole_restart() -> None:
    # A restart that is free against a heartbeat timeout of 10 minutes: the restart way wins, so the test above
    # could fail.
    job = replace(JOB, detect_s=0.0, restart_s=0.0, load_s=0.0, heartbeat_s=600.0)
    assert in_place_goodput(job).goodput < restart_goodput(job).goodput


def test_goodput_is_floored_at_zero_where_failures_come_faster_than_recovery() -> None:
    job = replace(JOB, gpus=100_000, mtbf_s=100 * HOUR, restart_s=600.0)  # the job fails every 3.6 s
    assert restart_goodput(job).goodput == 0.0


def test_settings_make_the_failures() -> None:
    settings = FailureSettings(mtbf_hours=50_000)
    f = failures_at(settings, gpus=64, step_s=0.5, params=1e9, gpus_per_node=8)
    # 12 bytes a parameter (fp32 weights, AdamW's two moments) at 10 GB/s: 1.2 s to save and to load.
    assert (f.state_bytes, f.save_s, f.load_s, f.group_gpus) == (12e9, 1.2, 1.2, 8)
    assert f.mtbf_s == 50_000 * HOUR and f.heal_Bps == 12.5e9
    given = FailureSettings(mtbf_hours=1, save_s=3, load_s=4, replica_group_gpus=2)
    f = failures_at(given, gpus=64, step_s=0.5, params=1e9, gpus_per_node=8)
    assert (f.save_s, f.load_s, f.group_gpus) == (3, 4, 2)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mtbf_hours": 0}, r"^mtbf_hours must be more than 0 \(got 0\)\.$"),
        ({"heal_gbps": float("nan")}, r"^heal_gbps must be more than 0 \(got nan\)\.$"),
        ({"restart_s": -1.0}, r"^restart_s must be 0 or more \(got -1.0\)\.$"),
        ({"replica_group_gpus": 0}, r"^replica_group_gpus must be 1 or more \(got 0\)\.$"),
    ],
)
def test_bad_failure_settings_are_refused_by_simulate(values, message) -> None:
    with pytest.raises(UsageError, match=message):
        SimulateRequest(params=1e9, compute_s=1.0, units_per_step=1, **values)


def test_simulate_prints_the_goodput_table_and_its_json(capsys) -> None:
    request = SimulateRequest(model="llama-3.1-8b", tflops="989", gpus="8,64,1024", mtbf_hours=50_000)
    simulate_request.run(request, as_json=False)
    out = capsys.readouterr().out
    assert "Goodput under failures, MTBF 50,000 h per GPU" in out
    assert "Young/Daly" in out and "replica group of 8 GPUs" in out
    simulate_request.run(request, as_json=True)
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["failures"]["in_place"] is None  # 8 GPUs: one group, no peer to heal from
    assert rows[2]["failures"]["in_place"]["goodput"] > rows[2]["failures"]["restart"]["goodput"]
    # Without --mtbf-hours nothing changes.
    simulate_request.run(SimulateRequest(model="llama-3.1-8b", tflops="989", gpus="8"), as_json=True)
    assert "failures" not in json.loads(capsys.readouterr().out)[0]


def test_gpus_of_different_speeds_are_not_simulated_under_failures() -> None:
    with pytest.raises(UsageError, match=r"^--mtbf-hours is simulated for GPUs of one speed"):
        simulate_request.run(SimulateRequest(params=1e9, tflops="4x989,4x312", mtbf_hours=1e4), as_json=False)
