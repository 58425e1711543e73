"""Goodput under failures: the share of wall-clock time spent on training steps that are kept, for a job of N GPUs
whose GPUs each fail once per MTBF on average (so the job fails at the rate N / MTBF), recovered two ways. Pure
arithmetic.

- Restart from checkpoint (`multigpu run --max-restarts`): every process stops and all restart from the last
  checkpoint. A failure costs the detection (the launcher's, or a hung collective's timeout), the restart (processes
  started, the model built, the checkpoint loaded) and the steps since the last save: half an interval on average.
  Saving costs its blocking time every interval, whose default is Young/Daly's optimum sqrt(2 x save x job MTBF).
- In place (torchft): data-parallel replica groups train; the failed GPU's group dies, the survivors wait out the
  lighthouse's heartbeat timeout, run the step again without it, and go on at (N - G) / N of the throughput while
  the group restarts and heals from a live peer (the state's bytes over the network). No step is lost; checkpoints
  are still taken, rarely: never more often than the restart way's.

The model is first order in the failure rate, as Young's and Daly's are: a failure is taken to be over before the
next one comes, which holds while the time lost per failure is small against the job's MTBF. Where it is not, the
goodput formula would go below zero; it is floored there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from multigpu.config.settings import Settings, setting
from multigpu.core.errors import require

#: Bytes per parameter a checkpoint holds and a heal copies: fp32 weights and AdamW's two fp32 moments (bf16 copies
#: of the weights are made again from them).
STATE_BYTES_PER_PARAM = 12


@dataclass
class FailureSettings(Settings):
    """`multigpu simulate`'s failure flags: with --mtbf-hours, goodput restarting from a checkpoint against in
    place."""

    mtbf_hours: float | None = setting(
        None,
        "mean time between failures of one GPU, hours: adds the goodput under failures, restart from checkpoint "
        "against in place (Llama 3's 16,384 H100s: about 50,000 h)",
    )
    detect_s: float = setting(
        15.0, "restart from checkpoint: seconds until a failure is seen (multigpu run's --node-timeout)"
    )
    heartbeat_s: float = setting(5.0, "in place: the lighthouse's heartbeat timeout, which the survivors wait out")
    restart_s: float = setting(60.0, "seconds to start the processes and build the model, before any state is read")
    save_s: float | None = setting(
        None, "seconds a checkpoint's save holds training (default: the state's bytes / --checkpoint-gb-s)"
    )
    load_s: float | None = setting(
        None, "seconds a checkpoint's load takes (default: the state's bytes / --checkpoint-gb-s)"
    )
    checkpoint_gb_s: float = setting(10.0, "GB/s the checkpoint storage writes and reads, the whole job together")
    checkpoint_interval_s: float | None = setting(
        None, "restart from checkpoint: seconds between saves (default: Young/Daly's sqrt(2 x save x job MTBF))"
    )
    heal_gbps: float = setting(
        100.0, "in place: Gbit/s at which each GPU of a restarted group copies its share of the state from a peer"
    )
    replica_group_gpus: int | None = setting(
        None, "in place: GPUs of one replica group, which fails and heals as one (default: --gpus-per-node)"
    )

    def check(self) -> None:
        # Each range is written as what passes, so that nan never does.
        positive = {"checkpoint_gb_s": self.checkpoint_gb_s, "heal_gbps": self.heal_gbps}
        positive |= {"mtbf_hours": self.mtbf_hours, "checkpoint_interval_s": self.checkpoint_interval_s}
        not_negative = {"detect_s": self.detect_s, "heartbeat_s": self.heartbeat_s, "restart_s": self.restart_s}
        not_negative |= {"save_s": self.save_s, "load_s": self.load_s}
        require(
            *((v is None or 0 < v <= math.inf, f"{k} must be more than 0 (got {v}).") for k, v in positive.items()),
            *((v is None or 0 <= v < math.inf, f"{k} must be 0 or more (got {v}).") for k, v in not_negative.items()),
            (
                self.replica_group_gpus is None or self.replica_group_gpus >= 1,
                f"replica_group_gpus must be 1 or more (got {self.replica_group_gpus}).",
            ),
        )


@dataclass(frozen=True)
class Failures:
    """What the goodput of one job depends on; times in seconds."""

    gpus: int  # N
    mtbf_s: float  # one GPU's mean time between failures (math.inf: none)
    step_s: float  # one training step at N GPUs
    state_bytes: float  # what a checkpoint holds and a heal copies
    group_gpus: int = 8  # G: one replica group, which fails, restarts and heals as one (in place)
    detect_s: float = 15.0  # restart way: until the failure is seen
    heartbeat_s: float = 5.0  # in place: the survivors' wait before they go on without the group
    restart_s: float = 60.0  # processes started and the model built, before any state is read
    save_s: float = 0.0  # training held by one checkpoint's save
    load_s: float = 0.0  # one checkpoint's load
    heal_Bps: float = 100e9 / 8  # bytes/s each GPU of a healing group copies its share of the state at
    interval_s: float | None = None  # restart way: one save's start to the next's; None: Young/Daly's
    in_place_interval_s: float = 3600.0  # in place: saves kept for what in place cannot heal, at least hourly


@dataclass(frozen=True)
class Goodput:
    """One way's result: useful time / wall time, and where the rest goes."""

    goodput: float
    lost_per_failure_s: float  # wall seconds of the whole job's training one failure costs
    interval_s: float  # one save's start to the next's (math.inf: never)
    steps_between_saves: float  # the steps of an interval (math.inf: never)
    checkpoint_share: float  # of wall time, spent saving


def failure_rate(f: Failures) -> float:
    """Failures per second of the whole job: each of its N GPUs fails once per MTBF."""
    return f.gpus / f.mtbf_s


def young_daly_interval_s(save_s: float, job_mtbf_s: float) -> float:
    """sqrt(2 x save x job MTBF): the interval that minimises save / interval + interval / (2 x job MTBF), the time
    spent saving plus the time lost to half an interval per failure (Young 1974; Daly 2006, to first order)."""
    return math.sqrt(2 * save_s * job_mtbf_s)


def restart_interval_s(f: Failures) -> float:
    """The restart way's interval: the one given, or Young/Daly's rounded to whole steps between saves (one at
    least, since a save comes between steps); math.inf without failures (no save would ever be read)."""
    if f.interval_s is not None:
        return f.interval_s
    if failure_rate(f) == 0:
        return math.inf
    ideal = young_daly_interval_s(f.save_s, f.mtbf_s / f.gpus)
    return max(1, round((ideal - f.save_s) / f.step_s)) * f.step_s + f.save_s


def heal_s(f: Failures) -> float:
    """A restarted group's copy of the state from a live peer: each of its G GPUs copies its 1/G (FSDP inside a
    replica group, as torchft's HSDP), all at once."""
    return f.state_bytes / (f.group_gpus * f.heal_Bps)


def restart_goodput(f: Failures) -> Goodput:
    """Restart from checkpoint: each failure costs the detection, the restart and load, and half an interval."""
    interval = restart_interval_s(f)
    return _goodput(f, interval, f.detect_s + f.restart_s + f.load_s + interval / 2)


def in_place_goodput(f: Failures) -> Goodput | None:
    """In place: each failure costs every GPU the heartbeat timeout and the step run again, and the group's share
    G / N of the throughput while it restarts and heals; None under two groups (no live peer to heal from)."""
    if f.gpus < 2 * f.group_gpus:
        return None
    away = f.restart_s + heal_s(f)
    lost = f.heartbeat_s + f.step_s + away * f.group_gpus / f.gpus
    # A save is rarer than the restart way's: it guards only against what a peer cannot heal (every group lost).
    return _goodput(f, max(f.in_place_interval_s, restart_interval_s(f)), lost)


def _goodput(f: Failures, interval_s: float, lost_s: float) -> Goodput:
    """1 - save / interval - rate x lost: the share of wall time left to kept steps, to first order."""
    share = f.save_s / interval_s if f.save_s else 0.0  # 0 / inf stays 0; inf / inf does not arise
    rate = failure_rate(f)
    goodput = max(0.0, 1 - share - (rate * lost_s if rate else 0.0))  # no failure: its loss is 0, never 0 x inf
    steps = round((interval_s - f.save_s) / f.step_s) if math.isfinite(interval_s) else math.inf
    return Goodput(goodput, lost_s, interval_s, steps, share)


def failures_at(settings: FailureSettings, gpus: int, step_s: float, params: float, gpus_per_node: int) -> Failures:
    """The Failures of a job of `gpus` GPUs training `params` parameters at `step_s` a step, as `settings` ask;
    save and load times from the state's bytes and the storage's bandwidth unless given."""
    require((settings.mtbf_hours is not None, "Give --mtbf-hours for the goodput under failures."))
    state = params * STATE_BYTES_PER_PARAM
    storage = settings.checkpoint_gb_s * 1e9
    return Failures(
        gpus=gpus,
        mtbf_s=settings.mtbf_hours * 3600,
        step_s=step_s,
        state_bytes=state,
        group_gpus=settings.replica_group_gpus or gpus_per_node,
        detect_s=settings.detect_s,
        heartbeat_s=settings.heartbeat_s,
        restart_s=settings.restart_s,
        save_s=state / storage if settings.save_s is None else settings.save_s,
        load_s=state / storage if settings.load_s is None else settings.load_s,
        heal_Bps=settings.heal_gbps * 1e9 / 8,
        interval_s=settings.checkpoint_interval_s,
    )
