"""Naming the rank that stopped reaching collectives (gloo): the message, its timing, and that everything exits."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from multigpu.observers import divergence, progress
from multigpu.observers.divergence import BLOCKED_S, EVALUATION, diverged
from multigpu.observers.progress import CollectiveTimeout, Progress, Where, describe, frozen
from tests.dist import multigpu, run_in_processes


class FakeStore:
    """The calls Progress makes on the process group's store, over a dict shared by the in-process 'ranks'."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.values[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(key in self.values for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self.lock:
            return [self.values[key] for key in keys]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self.lock:
            if self.values.get(key, b"") == expected.encode():
                self.values[key] = desired.encode()
            return self.values[key]

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        raise AssertionError("Progress polls instead: the store's wait logs a C++ warning when it expires")


def ranks(world: int, timeout_s: float = 3.0) -> list[Progress]:
    store = FakeStore()
    return [Progress(rank, world, timeout_s, store=store) for rank in range(world)]


def run_steps(rank: Progress, steps: int) -> None:
    for _ in range(steps):
        with rank.diagnose("forward"):
            pass
        rank.advance()
        with rank.diagnose("backward"):
            pass
        with rank.diagnose("optimizer step"):
            pass
        rank.finish_step()


def time_out_in(rank: Progress, op: str) -> str:
    with pytest.raises(CollectiveTimeout) as raised, rank.diagnose(op):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    return str(raised.value)


def test_describe_names_the_rank_that_stopped_with_its_exact_step_and_the_collective_the_others_wait_in() -> None:
    posts = {
        0: Where(2, 3, "backward", 3.0),
        1: Where(2, 2, None, 3.4),
        2: Where(2, 3, "backward", 3.0),
    }
    text, named = describe(0, 3.0, posts)
    assert named == [1]
    assert text.startswith(
        "Rank 1 stopped reaching collectives after optimizer step 2 (micro-step 2) and has been outside any "
        "collective for 3.4s, while ranks 0, 2 waited in backward (micro-step 3) past the 3s timeout:"
    )
    assert "printed its stack" not in text
    assert "it printed its stack" in describe(0, 3.0, posts, "it printed its stack")[0]


def test_describe_names_a_rank_in_a_different_collective_one_that_never_posted_and_a_shared_wait() -> None:
    posts = {0: Where(5, 5, "reduce", 4.0), 1: Where(5, 5, "save", 4.0), 2: None}
    text, named = describe(0, 4.0, posts)
    assert named == [1, 2]
    assert text.startswith(
        "Rank 1 is inside a different collective, save, after optimizer step 5 (micro-step 5); rank 2 never posted "
        "where it is (it died, or stopped before its first backward), while rank 0 waited in reduce"
    )
    assert "look at what those ranks do" in text
    text, named = describe(1, 4.0, {0: Where(5, 5, "reduce", 4.0), 1: Where(5, 5, "reduce", 4.0)})
    assert named == []
    assert "every rank is inside it at the same micro-step" in text


def test_a_rank_whose_posts_stand_still_is_said_to_be_stopped_whole_at_its_last_post_not_in_its_collective() -> None:
    """SIGSTOP stops the heartbeat too: the last post may be a beat old and show a collective the rank has long left."""
    before = {0: Where(2, 3, "backward", 3.0, beats=8), 1: Where(0, 0, "model forward", 0.1, beats=5)}
    after = {0: Where(2, 3, "backward", 3.7, beats=9), 1: Where(0, 0, "model forward", 0.1, beats=5)}
    assert frozen(before, after) == {1}
    text, named = describe(0, 3.0, after, frozen=frozen(before, after))
    assert named == [1]
    assert text.startswith(
        "Rank 1 stopped reaching collectives after optimizer step 0 (micro-step 0) or soon after, its heartbeat "
        "stopped too (the whole process is stopped:"
    )
    assert frozen(before, {**after, 1: after[1]._replace(beats=6)}) == set()  # one post more: it runs


def test_a_timeout_reads_fresh_posts_at_once_and_waits_only_for_the_named_rank_to_print_its_stack(
    capsys: pytest.CaptureFixture,
) -> None:
    waiting, stuck = ranks(2)
    run_steps(stuck, 2)  # two steps within a millisecond: a once-a-second post would still show micro-step 1
    run_steps(waiting, 2)
    waiting.advance()
    stuck.beat()

    def heartbeat_of_the_stuck_rank() -> None:
        while not stuck.beat():
            time.sleep(0.02)

    beating = threading.Thread(target=heartbeat_of_the_stuck_rank, daemon=True)
    beating.start()
    start = time.monotonic()
    text = time_out_in(waiting, "backward")
    # Two reads of the posts a beat and a half apart (its heartbeat posted in between: not stopped), and no more.
    assert time.monotonic() - start < 0.5 + 1.5 * progress.BEAT_S
    beating.join(timeout=5)
    assert re.match(
        r"Rank 1 stopped reaching collectives after optimizer step 2 \(micro-step 2\) and has been outside any "
        r"collective for [\d.]+s, while rank 0 waited in backward \(micro-step 3\) past the 3s timeout: .*; it "
        r"printed its stack\)\. The launcher stops every process\.$",
        text,
    )
    printed = capsys.readouterr().err
    assert "multigpu: rank 1 is the rank that rank 0 waited for in backward, after optimizer step 2" in printed
    assert "in time_out_in" in printed  # the stack of the main thread (here the test's own)
    assert (waiting.step, waiting.micro_step) == (2, 3)


def test_a_wait_that_outlives_its_timeout_without_raising_is_reported_by_the_heartbeat(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(progress, "WATCH_GRACE_S", 0.0)
    monkeypatch.setattr(progress, "ACK_S", 0.0)
    waiting, stuck = ranks(2, timeout_s=2.0)
    run_steps(stuck, 1)
    run_steps(waiting, 1)
    with waiting.diagnose("barrier"):
        with stuck.diagnose("barrier"):
            stuck.beat()
            assert not waiting.beat()
            assert "multigpu:" not in capsys.readouterr().err  # within the timeout: nothing to say yet
            waiting._at = (*waiting._at[:3], time.monotonic() - 2.5)  # as if it had waited 2.5s
            assert not waiting.beat()
            assert "multigpu:" not in capsys.readouterr().err  # every rank in there alike (a slow save): no one to name
        done = threading.Event()

        def heartbeat_of_the_stuck_rank() -> None:  # posts on while the waiting rank reads the posts twice
            while not done.wait(0.02):
                stuck._post()

        threading.Thread(target=heartbeat_of_the_stuck_rank, daemon=True).start()
        assert not waiting.beat()
        done.set()
    assert capsys.readouterr().err.startswith(
        "multigpu: Rank 1 stopped reaching collectives after optimizer step 1 (micro-step 1) and has been outside "
        "any collective for "
    )
    assert stuck.beat()  # the verdict names it


STUCK_SCRIPT = """
import signal, sys, time
import torch
from torch import nn
import multigpu as mg

engine = mg.Engine(strategy="ddp", timeout_s=float(sys.argv[1]))
model, _ = engine.setup(nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    for step in range(1, 100):
        engine.backward(model(torch.ones(2, 4)).sum())
        engine.step(optimizer)
        if step == 2 and engine.rank == 1:
            signal.signal(signal.SIGTERM, lambda *_: None)  # a handler that waits for a stuck main thread
            print(f"hang at {time.time()}", flush=True)
            while True:
                time.sleep(60)  # stuck here
except Exception:
    print(f"raised at {time.time()}", flush=True)
    raise
"""


def test_a_stuck_rank_that_ignores_sigterm_is_named_at_the_timeout_and_the_run_ends_soon_after(
    tmp_path: Path,
) -> None:
    # Measured before the heartbeat: the message came at the timeout + 2 s, and the launcher ended 38 s after the
    # hang (torchrun's 30 s before SIGKILL), blaming rank 1's SIGKILL with exit code 137.
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_SCRIPT)
    timeout_s = 3.0
    result = multigpu("run", "-n", "2", str(script), str(timeout_s), timeout=120)
    ended = time.time()
    hang = float(re.search(r"hang at ([\d.]+)", result.stdout).group(1))
    raised = float(re.search(r"raised at ([\d.]+)", result.stdout).group(1))
    assert raised - hang < timeout_s + 1.9, result.stdout
    assert ended - hang < timeout_s + 25, result.stdout
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stdout, result.stdout  # the sentence, said once by the launcher
    assert re.search(
        r"multigpu run: Rank 1 stopped reaching collectives after optimizer step 2 \(micro-step 2\) .*, while rank 0 "
        r"waited in backward \(micro-step 3\) past the 3s timeout: .*; it printed its stack\)",
        result.stdout,
    )
    # Without a log folder (a script's Engine may have none), the stuck rank prints its stack.
    stack = result.stdout.split("multigpu: rank 1 is the rank that rank 0 waited for in backward")[1]
    assert "time.sleep(60)  # stuck here" in stack


TRAIN = (("model forward", "train.py:20"), ("backward", "train.py:21"), ("optimizer step", "train.py:22"))


def post(op: str | None, calls: tuple, blocked_s: float = BLOCKED_S, step: int = 1, finished: bool = False) -> Where:
    return Where(step, step, op, blocked_s, len(calls), calls[-divergence.HISTORY :], blocked_s, finished)


def test_ranks_blocked_at_different_calls_or_beside_a_finished_one_diverged_and_nothing_else_did() -> None:
    evaluating = post(EVALUATION, (*TRAIN, (EVALUATION, "train.py:30")))
    training = post("backward", (*TRAIN, TRAIN[0], TRAIN[1]))
    text = diverged({0: evaluating, 1: training})
    assert text == (
        "The ranks went different ways at call 4 (Engine calls and model forwards counted), where rank 0 made a "
        "model forward without gradients (evaluation?) at train.py:30, rank 1 made a model forward at train.py:20, "
        "so the collectives they wait in never pair up: rank 0 waits in a model forward without gradients "
        "(evaluation?) at train.py:30 (optimizer step 1, micro-step 1), rank 1 waits in engine.backward at "
        "train.py:21 (optimizer step 1, micro-step 1); every rank must make the same Engine calls and model forwards "
        "in the same order: evaluate and save on every rank, and give every rank as many batches (engine.dataloader "
        "does)."
    )
    busy = post(EVALUATION, evaluating.history, blocked_s=0.4)  # computing: a long evaluation, a slow data path
    assert diverged({0: busy, 1: training}) is None
    assert diverged({0: busy, 1: training}, after_error=True) is not None  # a collective already failed
    assert diverged({0: training, 1: training}) is None  # the same call: a network fault, or a slow save
    crashed = post("backward", training.history)._replace(failed=True)  # its own error: the launcher says it
    assert diverged({0: evaluating, 1: crashed}, after_error=True) is None
    # Rank 0 still inside the save rank 1 finished (syncing to a slow disk stands as still as a wait): behind, not
    # apart; the same one call ahead, past a rank that finished before making it, is a divergence.
    saving = post("save", (*TRAIN, ("save", "train.py:40")))
    ahead = post("model forward", (*TRAIN, ("save", "train.py:40"), TRAIN[0]))
    assert diverged({0: saving, 1: ahead}) is None
    assert diverged({0: post(None, saving.history, 0.0, finished=True), 1: ahead}) is not None
    assert diverged({0: post(None, saving.history, 0.0, finished=True), 1: saving}) is None  # its last call
    assert diverged({0: evaluating, 1: None}) is None  # a rank that never posted: nothing to compare
    finished = post(None, TRAIN, blocked_s=0.0, finished=True)
    assert "rank 0 never made it" in diverged({0: finished, 1: training})
    assert "rank 0 has finished its script" in diverged({0: finished, 1: training})
    assert diverged({0: finished, 1: finished}) is None


def test_only_a_collectives_own_failure_counts_as_one_and_an_error_passing_through_torch_distributed_does_not() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Shard

    def raised(call) -> BaseException:
        try:
            call()
        except BaseException as error:  # whatever it raised is what is judged
            return error
        raise AssertionError("it did not raise")

    assert divergence.from_a_collective(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert divergence.from_a_collective(dist.DistBackendError("a backend failed"))
    c10d = compile("raise RuntimeError('a collective timed out')", dist.distributed_c10d.__file__, "exec")
    assert divergence.from_a_collective(raised(lambda: exec(c10d)))  # raised in c10d's own collective call
    assert not divergence.from_a_collective(ValueError("gloo"))
    # A script's own mistake that DTensor's Python code raises (under torch/distributed, in no collective): the
    # traceback is shown, not a divergence sentence.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        mixed = raised(lambda: DTensor.from_local(torch.ones(2), mesh, [Shard(0)]).redistribute(mesh, [Partial()]))
    finally:
        dist.destroy_process_group()
    assert isinstance(mixed, RuntimeError) and "redistribute" in str(mixed)
    assert not divergence.from_a_collective(mixed)


def test_a_rank_that_sees_a_divergence_twice_says_it_once_and_ends_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    ended = []
    monkeypatch.setattr(progress, "_end_process", lambda code=2: ended.append(code))
    monkeypatch.setattr(progress, "ACK_S", 0.05)
    monkeypatch.setattr(divergence, "CONFIRM_S", 0.0)
    first, second = ranks(2)
    with first.diagnose("save"), second.diagnose("backward"):
        for rank in (first, second):
            rank._clock.blocked_s = lambda call: BLOCKED_S  # the test's own main thread is busy
            rank._post()
        first._check_divergence()  # seen once: a post may lag a beat
        assert ended == []
        first._check_divergence()
        second.beat()  # sees the verdict: acknowledges it and ends without a word
    assert ended == [2, 2]
    printed = capsys.readouterr().err
    assert printed.count("multigpu: error: The ranks went different ways") == 1
    assert "rank 0 waits in engine.save at test_progress.py:" in printed


EVALUATE_ON_RANK_0 = """
import sys, torch
from torch import nn
import multigpu as mg

engine = mg.Engine(strategy=sys.argv[1])  # the default timeout: 30 minutes
model, _ = engine.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

@torch.no_grad()
def estimate_loss():  # nanoGPT's, called on the master process only
    model.eval()
    loss = model(torch.ones(4, 8)).sum()  # evaluation forward
    model.train()
    return loss

for step in range(1, 50):
    loss = model(torch.ones(4, 8)).sum()  # training forward
    engine.backward(loss)
    engine.step(optimizer)
    if step == 3 and engine.rank == 0:
        estimate_loss()
    if step == 3 and engine.rank == 1 and sys.argv[1] == "ddp":
        engine.save(sys.argv[2], {"model": model})  # save alone
"""


def line_of(script: str, text: str) -> int:
    return next(number for number, line in enumerate(script.splitlines(), 1) if text in line)


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_ranks_that_go_different_ways_are_named_in_seconds_in_one_sentence(strategy: str, tmp_path: Path) -> None:
    # zero3: rank 0 evaluates alone (FSDP all-gathers in forward); ddp: rank 0 evaluates alone (no collective, legit)
    # and rank 1 saves alone. Before: a hang until the 30-minute timeout, or gloo's traces and Python's.
    script = tmp_path / "train.py"
    script.write_text(EVALUATE_ON_RANK_0)
    started = time.monotonic()
    # Without the suite's PYTHONFAULTHANDLER, as a user runs it: gloo's abort of a rank would print every stack.
    quiet = {"PYTHONFAULTHANDLER": ""}
    result = multigpu("run", "-n", "2", str(script), strategy, str(tmp_path / "ckpt"), timeout=90, env=quiet)
    seconds = time.monotonic() - started
    print(f"{strategy}: the run ended {seconds:.1f}s after it started")  # the figure reported (-s)
    output = result.stdout
    assert seconds < 60, output  # a hang guard: the collective timeout is 1800 s
    assert "Traceback" not in output and "[rank" not in output, output
    if strategy == "zero3":
        # gloo aborts the rank whose all-gather got data of another size (its two C++ lines are all it prints); the
        # survivor's diagnosis and the launcher's report of that abort race: one of the two sentences ends the run.
        assert len(output.strip().splitlines()) <= 3, output
        if result.returncode == 134:
            assert output.count("by a library's own check") == 1 and "collective mismatch" in output, output
            return
        evaluation = f"train.py:{line_of(EVALUATE_ON_RANK_0, '# evaluation forward')}"
        assert f"rank 0 made a model forward without gradients (evaluation?) at {evaluation}" in output, output
    assert result.returncode == 2, output
    assert output.count("multigpu: error: The ranks went different ways") == 1, output
    if strategy == "ddp":
        save = f"train.py:{line_of(EVALUATE_ON_RANK_0, '# save alone')}"
        assert f"rank 1 waits in engine.save at {save}" in output, output
        backward = f"train.py:{line_of(EVALUATE_ON_RANK_0, 'engine.backward(loss)')}"
        assert f"rank 0 waits in engine.backward at {backward}" in output, output
        assert len(output.strip().splitlines()) == 1, output


UNEVEN_BATCHES = """
import torch
from torch import nn
import multigpu as mg

engine = mg.Engine(strategy="pp")
model, _ = engine.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3 + engine.rank):  # rank 1 has one batch more
    engine.forward_backward(model, torch.ones(4, 8), torch.zeros(4, 1), lambda out, t: ((out - t) ** 2).mean())
    engine.step(optimizer)
"""


def test_a_rank_left_in_the_loop_after_the_others_finished_is_named(tmp_path: Path) -> None:
    # pp: rank 1's extra schedule step waits for activations from rank 0, which has finished its script.
    script = tmp_path / "train.py"
    script.write_text(UNEVEN_BATCHES)
    started = time.monotonic()
    result = multigpu("run", "-n", "2", str(script), timeout=90)
    print(f"uneven batches: the run ended {time.monotonic() - started:.1f}s after it started")
    assert result.returncode == 2, result.stdout
    assert result.stdout.startswith("multigpu: error: The ranks went different ways at call 7"), result.stdout
    assert "rank 0 has finished its script, rank 1 waits in engine.forward_backward at train.py:10" in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1, result.stdout


def drop_the_engine_on_rank_1() -> None:
    """In each rank of the test below: one step, then rank 1 lets its Engine go before its script ends."""
    import gc

    import torch

    import multigpu as mg

    engine = mg.Engine(strategy="ddp")
    model, optimizer = engine.setup(torch.nn.Linear(4, 1), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
    engine.backward(model(torch.ones(2, 4)).sum())
    engine.step(optimizer)
    if engine.rank == 1:
        del engine, model, optimizer
        gc.collect()


def test_a_rank_whose_engine_was_collected_before_its_script_ended_still_counts_as_finished() -> None:
    # Each rank waits at its script's end until every rank's has ended (Progress.finish). Before: a rank whose
    # Engine had been collected posted nothing more, and its peer waited for it the whole 30-minute timeout (seen
    # under load, where the garbage collector's timing differs between ranks: 2 in 60 runs of two Engines in turn).
    run_in_processes("tests.observers.test_progress:drop_the_engine_on_rank_1", 2, timeout=30)
