"""The streamed loader's contract: every sample of every epoch exactly once across world sizes, one window in memory.

The ranks train in real processes through Engine.dataloader (one launch of 2 processes, one of 3); the states they
resume from are either theirs or one computed here with a loader per rank, which the 3-process launch then checks.
"""

from __future__ import annotations

import gc
import itertools
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

import multigpu as mg
from multigpu.core.errors import UsageError
from multigpu.data.stream import StreamLoader, WindowedStream
from multigpu.engine.lr_schedule import SampleSchedule, warmup_cosine
from tests.dist import run_each_in_processes

SIZES = [5, 1, 7, 3, 0, 6, 2, 4]  # windows of varying sizes, as packed bins are; one empty
EPOCH = sum(SIZES)  # 28 samples
BATCH, ACCUM, SEED = 2, 2, 5
BEFORE = {2: 5, 3: 3}  # optimizer steps before the checkpoint, by world size: both cross an epoch's end
AFTER = {2: 7, 3: 4}  # steps after the resume, by world size: enough to finish epoch 2
BASE_LR, PLAN = 0.1, (2 * 8, 12 * 8)  # warm-up and total samples of the schedule


class Sample:
    """A sample that counts how many of its kind are alive, to see what the loader holds."""

    live = 0

    def __init__(self, value: int) -> None:
        self.value = value
        Sample.live += 1

    def __del__(self) -> None:
        Sample.live -= 1


class Bins:
    """A WindowedStream of windows of SIZES; sample ids are epoch * 1000 + the sample's place in the stream."""

    def __init__(self, sizes: list[int] = SIZES) -> None:
        self.sizes = sizes
        self.live_when_made: list[int] = []  # samples alive as each window is made

    def windows(self, epoch: int, first: int) -> Iterator[list[Sample]]:
        start = sum(self.sizes[:first])
        for size in self.sizes[first:]:
            self.live_when_made.append(Sample.live)
            yield [Sample(epoch * 1000 + start + i) for i in range(size)]  # bound to no name: made, then let go
            start += size


def values(samples: list[Sample]) -> torch.Tensor:
    return torch.tensor([sample.value for sample in samples])


def loader(
    world: int, rank: int, stream: WindowedStream | None = None, batch: int = BATCH, shares: tuple | None = None
) -> StreamLoader:
    return StreamLoader(
        stream or Bins(),
        batch_size=batch,
        shuffle=True,
        collate_fn=values,
        rank=rank,
        world_size=world,
        grad_accum_steps=ACCUM,
        seed=SEED,
        device=torch.device("cpu"),
        shares=shares,
    )


def train(strategy: str, steps: int, batch: int = BATCH, resume: dict | None = None) -> dict:
    """`steps` optimizer steps of a Linear over the stream through the Engine (from `resume`'s states if given):
    each micro-batch's values on this rank, the gathered global batches, each update's lr, the states at the end."""
    engine = mg.Engine(strategy, grad_accum_steps=ACCUM, seed=SEED)
    model = torch.nn.Linear(1, 1)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=BASE_LR))
    data = engine.dataloader(Bins(), batch_size=batch, collate_fn=values)
    assert isinstance(data, StreamLoader)
    schedule = SampleSchedule(optimizer, data, *PLAN)
    if resume is not None:
        data.load_state_dict(resume["loader"])
        schedule.load_state_dict(resume["schedule"])
    mine, gathered, lrs, updates = [], [], [], []
    for batch_values in data:
        mine.append(batch_values.tolist())
        gathered.append(engine.gather(batch_values).tolist())
        lrs.append(optimizer.param_groups[0]["lr"])
        x = batch_values.float().unsqueeze(1) / 1000
        engine.forward_backward(model, x, None, lambda out, _: out.pow(2).mean())
        updates.append(engine.step(optimizer, schedule))
        if updates[-1] and len(lrs) == steps * ACCUM:
            break
    states = {"loader": data.state_dict(), "schedule": schedule.state_dict()}
    return {"mine": mine, "gathered": gathered, "lrs": lrs[::ACCUM], "updates": updates, **states}


def take(world: int, steps: int) -> tuple[list[list[int]], dict]:
    """The first `steps` optimizer steps at `world` ranks, with a loader per rank in this process: the values of
    each global batch, and the state after them."""
    ranks = [loader(world, rank) for rank in range(world)]
    batches = [list(itertools.islice(rank_loader, steps * ACCUM)) for rank_loader in ranks]
    states = [rank_loader.state_dict() for rank_loader in ranks]
    assert all(state == states[0] for state in states)  # nothing in it depends on the rank
    return global_batches([[rank[i].tolist() for i in range(steps * ACCUM)] for rank in batches]), states[0]


def global_batches(rank_batches: list[list[list[int]]]) -> list[list[int]]:
    """The ranks' micro-batch values side by side, as one sorted list per global batch."""
    return [sorted(itertools.chain.from_iterable(step)) for step in zip(*rank_batches, strict=True)]


FRESH_SCHEDULE = {"warmup_samples": PLAN[0], "total_samples": PLAN[1], "skipped_samples": 0, "base_lrs": [BASE_LR]}


@pytest.fixture(scope="module")
def runs() -> dict:
    simulated = take(3, BEFORE[3])
    resume_3 = {"loader": simulated[1], "schedule": FRESH_SCHEDULE}
    calls_2 = [dict(strategy="ddp", steps=BEFORE[2]), dict(strategy="ddp", steps=AFTER[2], resume=resume_3)]
    two = run_each_in_processes("tests.data.test_stream:train", 2, calls_2, timeout=60)
    resume_2 = {"loader": two[0][0]["loader"], "schedule": two[0][0]["schedule"]}
    calls_3 = [dict(strategy="ddp", steps=BEFORE[3]), dict(strategy="ddp", steps=AFTER[3], resume=resume_2)]
    three = run_each_in_processes("tests.data.test_stream:train", 3, calls_3, timeout=60)
    return {"simulated": simulated, "two": two, "three": three}


def each_once_over_whole_epochs(batches: list[list[int]], epochs: int) -> None:
    seen = Counter(value for batch in batches for value in batch)
    assert max(seen.values()) == 1
    for epoch in range(epochs):
        assert sorted(v - epoch * 1000 for v in seen if v // 1000 == epoch) == list(range(EPOCH))


def test_resume_from_2_to_3_processes_sees_each_sample_once(runs: dict) -> None:
    before = global_batches([rank[0]["mine"] for rank in runs["two"]])
    after = global_batches([rank[1]["mine"] for rank in runs["three"]])
    assert len(before) == BEFORE[2] * ACCUM and all(len(b) == BATCH * 2 for b in before)
    assert all(len(b) == BATCH * 3 for b in after)  # full batches across the epochs' ends
    each_once_over_whole_epochs(before + after, epochs=3)  # 40 + 48 samples: epochs 0-2 and 4 of epoch 3


def test_resume_from_3_to_2_processes_sees_each_sample_once(runs: dict) -> None:
    simulated_batches, simulated_state = runs["simulated"]
    real = [rank[0] for rank in runs["three"]]
    assert global_batches([rank["mine"] for rank in real]) == simulated_batches
    assert all(rank["loader"] == simulated_state for rank in real)
    after = global_batches([rank[1]["mine"] for rank in runs["two"]])
    each_once_over_whole_epochs(simulated_batches + after, epochs=3)  # 36 + 56 samples


@pytest.mark.parametrize(("world", "call"), [(2, 0), (3, 0), (3, 1)])
def test_gather_gives_each_global_batch_in_stream_order(runs: dict, world: int, call: int) -> None:
    """Every rank gets the whole global batch; in stream order it is the ranks' values interleaved. At 3 ranks
    global batches of 6 straddle the ends of epochs of 28 samples."""
    ranks = [rank[call] for rank in runs["two" if world == 2 else "three"]]
    steps = zip(*[rank["mine"] for rank in ranks], strict=True)
    expected = [[value for column in zip(*step, strict=True) for value in column] for step in steps]
    assert any(len({v // 1000 for v in batch}) > 1 for batch in expected) == (world == 3)
    assert all(rank["gathered"] == expected for rank in ranks)


def test_one_process_makes_the_same_global_batches_and_lrs(runs: dict) -> None:
    one = train("single", BEFORE[2], batch=BATCH * 2)
    two = [rank[0] for rank in runs["two"]]
    assert [sorted(b) for b in one["mine"]] == global_batches([rank["mine"] for rank in two])
    assert one["updates"] == two[0]["updates"] == ([False] * (ACCUM - 1) + [True]) * BEFORE[2]
    assert one["lrs"] == two[0]["lrs"] == two[1]["lrs"]
    # ...and after the resume at 3 the lr follows the samples: the factor where each update's data ends.
    resumed = runs["three"][0][1]["lrs"]
    start = BEFORE[2] * 8
    assert resumed == [BASE_LR * warmup_cosine(start + 12 * (i + 1), *PLAN) for i in range(AFTER[3])]


def test_shares_split_each_global_batch_by_weight_and_resume_evenly() -> None:
    one = [sorted(b.tolist()) for b in itertools.islice(loader(1, 0, batch=BATCH * 2), 20)]  # 40 samples: 2 epochs
    shared = [loader(2, rank, shares=(3, 1)) for rank in range(2)]
    steps = list(zip(*(itertools.islice(part, 12) for part in shared), strict=True))
    assert all([len(part) for part in step] == [3, 1] for step in steps)  # 4 samples a step, split 3:1
    assert [sorted(torch.cat(step).tolist()) for step in steps] == one[:12]
    even = [loader(2, rank) for rank in range(2)]
    for part in even:
        part.load_state_dict(shared[0].state_dict())
    rest = zip(*(itertools.islice(part, 8) for part in even), strict=True)
    assert [sorted(torch.cat(step).tolist()) for step in rest] == one[12:]
    # Shares changed between two batches (batch_shares auto): the next global batch is split the new way.
    moved = [loader(2, rank, shares=(3, 1)) for rank in range(2)]
    passes, steps = [iter(part) for part in moved], []
    for step in range(4):
        steps.append([next(part) for part in passes])
        if step == 1:
            for part in moved:
                part.set_shares((1.0, 3.0))
    assert [[len(part) for part in step] for step in steps] == [[3, 1], [3, 1], [1, 3], [1, 3]]
    assert [sorted(torch.cat(step).tolist()) for step in steps] == one[:4]


def test_state_dict_round_trip_continues_with_the_same_batches() -> None:
    first = loader(2, 1)
    list(itertools.islice(first, 9))  # into the second epoch
    state = first.state_dict()
    second = loader(2, 1)
    second.load_state_dict(state)
    assert second.state_dict() == state and second.samples_seen == 9 * BATCH * 2
    assert [b.tolist() for b in itertools.islice(second, 5)] == [b.tolist() for b in itertools.islice(first, 5)]


def test_a_pass_left_midway_loses_nothing() -> None:
    broken = loader(1, 0)
    parts = [b.tolist() for b in itertools.islice(broken, 3)] + [b.tolist() for b in itertools.islice(broken, 3)]
    assert parts == [b.tolist() for b in itertools.islice(loader(1, 0), 6)]


def test_each_epoch_and_window_has_its_own_permutation() -> None:
    batches = [b.tolist() for b in itertools.islice(loader(1, 0, batch=EPOCH), 2)]  # a batch per epoch
    assert [v % 1000 for v in batches[0]] != [v % 1000 for v in batches[1]]
    bounds = list(itertools.pairwise(itertools.accumulate([0, *SIZES])))
    for batch in batches:  # each window's samples stay together, in the windows' order, permuted within
        assert [sorted(v % 1000 for v in batch[a:b]) for a, b in bounds] == [list(range(a, b)) for a, b in bounds]
    assert batches[0] != sorted(batches[0])


def test_holds_one_window_at_a_time() -> None:
    sizes = [5 + (w * 7) % 8 for w in range(200)]  # windows of 5 to 12 samples, each larger than a batch
    stream = Bins(sizes)
    gc.collect()  # samples other tests left in reference cycles (a traceback's frames)
    before = Sample.live
    for _ in itertools.islice(loader(2, 0, stream), 2000):  # over several epochs
        pass
    # When a window is made, the loader holds only this rank's samples of the batch under way (at most BATCH) and
    # the one it last read: keeping the previous window would show 5 or more.
    assert len(stream.live_when_made) > 2 * len(sizes) and max(stream.live_when_made) - before <= BATCH + 1


def test_refusals() -> None:
    with pytest.raises(UsageError, match="length is not known"):
        len(loader(1, 0))
    with pytest.raises(UsageError, match="no samples for epoch 0"):
        next(iter(loader(1, 0, Bins([0, 0]))))
    with pytest.raises(UsageError, match="num_workers must be 0"):
        settings = dict(collate_fn=None, rank=0, world_size=1, grad_accum_steps=1, seed=0, device=torch.device("cpu"))
        StreamLoader(Bins(), batch_size=1, shuffle=True, num_workers=2, **settings)
    with pytest.raises(UsageError, match="an in-memory loader's"):
        loader(1, 0).load_state_dict({"epoch": 0, "position": 3, "seed": SEED, "shuffle": 1})
    late = loader(1, 0)
    late.load_state_dict({**late.state_dict(), "window": 1, "offset": 4})  # window 1 has 1 sample
    with pytest.raises(UsageError, match="past the end of that window of 1 samples"):
        next(iter(late))
