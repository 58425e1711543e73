"""Fault tolerance across replica groups (engine/replicas.py), as a user runs it: `multigpu run --replica-groups N`
of a loop written as users write theirs (tests/scripts/replica_fit.py), a group's worker SIGKILLed at a chosen step.

Each launch checks the whole promise at once: the other groups' processes never change; the next committed step
comes within 10 s of the loss (the lighthouse notices a dead group after its 5 s heartbeat timeout); after every
step, and so right after a group healed, every group's weights are the same bits; and the run ends where one
process ends on the same global batches, within 1e-5 (a step run again splits its global batch among fewer ranks:
the same samples summed in another order, an fp32 rounding apart per step, ~1e-7 here over 16 steps).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from multigpu.core.ports import free_port
from tests.dist import ROOT, multigpu, refusal, running

pytest.importorskip("torchft")
SCRIPT = str(ROOT / "tests" / "scripts" / "replica_fit.py")
STEPS = 100
STEP_S = 0.4  # each step's least time while a group is missing (replica_fit.py)
CPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def one_process_loss() -> float:
    """The validation loss of the same global batches trained in one process, without fault tolerance."""
    result = multigpu("run", "-n", "1", SCRIPT, "single", str(STEPS), timeout=120, env=CPU)
    assert result.returncode == 0, result.stdout
    return final_losses(result.stdout)["-"]


def final_losses(output: str) -> dict[str, float]:
    return {group: float(loss) for group, loss in re.findall(r"val group=(\S+) loss=(\S+)", output)}


def check_groups_agree(output: str, groups: int) -> None:
    """Every group's weights after every step it committed are the same bits as every other group's there."""
    hashes: dict[str, set[str]] = {}
    for _group, step, digest in re.findall(r"hash group=(\d+) step=(\d+) weights=(\w+)", output):
        hashes.setdefault(step, set()).add(digest)
    assert len(hashes) == STEPS, output
    assert all(len(digests) == 1 for digests in hashes.values()), hashes
    assert len(final_losses(output)) == groups, output


def check_every_group_trains_after_healing(output: str, groups: int) -> None:
    """Once the lost group healed for the last time, every group trained every step: none was kept out of a quorum
    (a quorum that formed without a live group that was late would keep one out of every later one)."""
    healed = max(int(step) for step in re.findall(r"healed from a live replica group at step (\d+)", output))
    trained: dict[int, set[str]] = {}
    for group, step in re.findall(r"hash group=(\d+) step=(\d+)", output):
        trained.setdefault(int(step), set()).add(group)
    short = {step: sorted(trained[step]) for step in range(healed + 1, STEPS + 1) if len(trained[step]) < groups}
    assert not short, f"steps after the heal at step {healed} trained by fewer groups: {short}"


def pids(output: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for group, pid in re.findall(r"pid group=(\d+) pid=(\d+)", output):
        found.setdefault(group, []).append(pid)
    return found


@pytest.mark.parametrize(
    ("strategy", "groups", "nproc", "attempts"),
    [("ddp", 3, 1, 2), ("hsdp", 2, 2, 1)],
    ids=[
        "ddp, 3 groups of 1, a group lost twice after a step",
        "hsdp, 2 groups of 2 (FSDP2 shards inside each), a group lost inside a step",
    ],
)
def test_a_lost_group_restarts_alone_heals_and_the_run_ends_as_one_process(
    strategy: str, groups: int, nproc: int, attempts: int, one_process_loss: float
) -> None:
    fault = f"kill,step=3,group=1,attempts={attempts}" if attempts > 1 else "kill-in-step,step=3,group=1"
    result = multigpu(
        "run", "--replica-groups", str(groups), "-n", str(nproc), "--max-restarts", str(attempts), SCRIPT,
        strategy, str(STEPS), str(STEP_S), timeout=240, env={**CPU, "MULTIGPU_FAULT": fault},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout
    out = result.stdout
    started_pids = pids(out)
    assert len(started_pids["1"]) == 1 + attempts, out  # group 1 started again after each loss
    assert all(len(started_pids[str(g)]) == 1 for g in range(groups) if g != 1), out  # the others, never
    check_groups_agree(out, groups)
    if attempts == 1:  # lost inside step 4: the others' collectives with it failed, and they ran it again
        assert "replica group 0: step 4 runs again on the same global batch" in out, out
    assert "replica group 1: healed from a live replica group at step" in out, out
    check_every_group_trains_after_healing(out, groups)
    losses = final_losses(out)
    assert all(abs(loss - one_process_loss) <= 1e-5 for loss in losses.values()), (losses, one_process_loss)
    # Group 0 trained every step, its first after each loss within 10 s of its step before (the heartbeat timeout
    # is 5 s).
    at = {int(step): float(t) for step, t in re.findall(r"hash group=0 step=(\d+) \S+ at=(\S+)", out)}
    assert sorted(at) == list(range(1, STEPS + 1)), out
    assert max(at[step + 1] - at[step] for step in range(1, STEPS)) < 10, at


@pytest.mark.parametrize(
    ("flags", "sentence"),
    [
        (("--multi-gpu", "zero1"), "strategy zero1 is not one of them"),
        (("--multi-gpu", "pp", "--nproc", "2"), "strategy pp is not one of them"),
        (("--tp-size", "2", "--nproc", "2"), "drop --tp-size 2 or --fault-tolerance"),
        (("--precision", "fp16-mixed"), "drop --precision fp16-mixed or --fault-tolerance"),
        (("--optimizer", "adamw-8bit"), "drop --optimizer adamw-8bit or --fault-tolerance"),
        (("--batch-shares", "2,1", "--nproc", "2"), "drop --batch-shares 2,1 or --fault-tolerance"),
    ],
)
def test_what_fault_tolerance_does_not_carry_is_refused_before_any_worker(flags: tuple[str, ...], sentence: str):
    printed = refusal("finetune", "--model", "tiny", "--fault-tolerance", "--replica-groups", "2", *flags)
    assert sentence in printed and printed.count("\n") == 1, printed


def test_fault_tolerance_without_replica_groups_is_refused() -> None:
    printed = refusal("demo", "--fault-tolerance")
    assert "pass --replica-groups N (2 or more)" in printed, printed


def test_a_lost_lighthouse_ends_every_group_in_one_sentence() -> None:
    port = free_port()
    groups = []
    with running("lighthouse", "--port", str(port), "--bind-address", "127.0.0.1") as lighthouse:
        time.sleep(2)
        for group in range(2):
            joining = ("--replica-groups", "2", "--replica-id", str(group), "--lighthouse", f"127.0.0.1:{port}")
            groups.append(_background("run", *joining, "-n", "1", SCRIPT, "ddp", "100000"))
        _wait_for(groups[0], "hash group=0 step=3", timeout=180)
        lighthouse.kill()
    for process in groups:
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 2, output
        assert re.search(
            rf"The lighthouse at 127\.0\.0\.1:{port} stopped answering at step \d+; start it again \(multigpu "
            r"lighthouse\) and restart the run from its last checkpoint\.",
            output,
        ), output
        assert "Traceback" not in output, output


def _background(*args: str) -> subprocess.Popen:
    # A quorum waits 60 s for the lighthouse by default; the sentence is the same after 10.
    env = {**os.environ, **CPU, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TORCHFT_QUORUM_TIMEOUT_SEC": "10"}
    return subprocess.Popen(
        [sys.executable, "-m", "multigpu", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip


def _wait_for(process: subprocess.Popen, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if text in line:
            return
        if not line and process.poll() is not None:
            break
    process.kill()
    raise AssertionError(f"never printed {text!r}:\n{''.join(seen)}")
