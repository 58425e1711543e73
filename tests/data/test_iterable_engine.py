"""Training from iterable datasets through Engine.dataloader on 2 real processes, under ddp and zero3, against one
process: a torch IterableDataset, and a Hugging Face streaming dataset over JSON lines files read by 2 DataLoader
workers per rank. Each is trained as a script is shaped, `for epoch in range(2): for batch in loader:`, with no step
budget: each `for` ends at the end of the stream's 33 samples, after 4 global batches of 8 and one of 1 (which the
second process pads). One launch runs all four; the ddp run over the torch dataset also saves checkpoints mid-epoch
and after the epoch's last batch, which one process resumes from.

Each step's global batch is the stream's next 8 samples (or the epoch's last 1) whatever the process count
(engine.gather of the ids on each rank equals one process's batch, exactly), so the weights differ only by the order
of the sums: one process takes the mean of 8 losses, two take the mean of two means of 4, and of the last batch's
one sample one process takes it whole, two its loss weighted 2 on rank 0 and the padding's 0 on rank 1, averaged
(measured worst 1.5e-8 in fp32). atol 1e-6 holds that, and a sample swapped between any two neighbouring batches
moves the weights by 8e-5 or more (measured).
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

import multigpu as mg
from multigpu.data.iterable import IterableStream
from tests.dist import run_each_in_processes

FILE_SIZES = (17, 16)  # a stream of 33 samples: global batches of 8, 8, 8, 8 and 1
SAMPLES, EPOCH_STEPS = sum(FILE_SIZES), 5
GLOBAL_BATCH, EPOCHS, WINDOW, SEED = 8, 2, 16, 5
SAVES = (3, 5)  # checkpoints after these steps: mid-epoch, and after the epoch's last batch
SOURCES = {"torch": 0, "hf": 2}  # source -> DataLoader workers per rank
STRATEGIES = ("ddp", "zero3")


class Ids(IterableDataset):
    """The ids 0..32, each DataLoader worker reading every num_workers-th."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(torch.arange(SAMPLES)[first::step])


def json_files(folder: Path) -> list[str]:
    """The same 33 ids as records {"id"} of JSON lines files of FILE_SIZES records."""
    paths = []
    for f, size in enumerate(FILE_SIZES):
        path = folder / f"ids{f}.jsonl"
        if not path.exists():
            first = sum(FILE_SIZES[:f])
            path.write_text("".join(json.dumps({"id": first + i}) + "\n" for i in range(size)))
        paths.append(str(path))
    return paths


def source(name: str, folder: str) -> Any:
    if name == "torch":
        return Ids()
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset("json", data_files=json_files(Path(folder)), split="train", streaming=True)


def collate(samples: list[Any]) -> torch.Tensor:
    return torch.tensor([int(s["id"]) if isinstance(s, dict) else int(s) for s in samples])


def features(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's inputs and target, from its id."""
    i = ids.double()
    x = torch.stack([torch.sin(i), torch.cos(0.7 * i), i / 40], dim=1).float()
    return x, x @ torch.tensor([[0.5], [-1.0], [2.0]]) + 0.1


def train(name: str, strategy: str, folder: str, save: bool = False, resume: int = 0) -> dict:
    """EPOCHS epochs of a Linear over the source, a `for` each (from the checkpoint after step `resume` if given;
    writing those after SAVES with `save`): the ids of each global batch as engine.gather gives them, and the weights
    at the end."""
    if strategy != "single":  # in a rank
        # A rank forked from tests/dist.py's server inherits its start method, whose children would run this script
        # again; under `multigpu run` DataLoader workers fork, as here.
        multiprocessing.set_start_method("fork", force=True)
    engine = mg.Engine(strategy, seed=SEED)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stream = IterableStream(source(name, folder), window=WINDOW)
    batch = GLOBAL_BATCH // engine.world_size
    data = engine.dataloader(stream, batch_size=batch, num_workers=SOURCES[name], collate_fn=collate)
    if resume:
        engine.load(Path(folder) / f"{name}-{resume}", {"model": model, "optimizer": optimizer, "loader": data})
    batches, step = [], resume
    for _ in range(data.epoch, EPOCHS):  # a script's loop: each `for` ends with the stream
        for ids in data:
            batches.append(engine.gather(ids).tolist())
            x, y = features(ids)
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            engine.step(optimizer)
            step += 1
            if save and step in SAVES:
                engine.save(Path(folder) / f"{name}-{step}", {"model": model, "optimizer": optimizer, "loader": data})
    state = engine.model_state_dict(model)
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
    return {"batches": batches, "weights": weights}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = str(tmp_path_factory.mktemp("iterable"))
    calls = [
        dict(name=name, strategy=strategy, folder=folder, save=(name, strategy) == ("torch", "ddp"))
        for name in SOURCES
        for strategy in STRATEGIES
    ]
    two = run_each_in_processes("tests.data.test_iterable_engine:train", 2, calls, timeout=120)
    one = {name: train(name, "single", folder) for name in SOURCES}
    return {"two": two, "one": one, "folder": folder}


@pytest.mark.parametrize("name", SOURCES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_processes_train_on_one_process_batches_to_its_weights(runs: dict, name: str, strategy: str) -> None:
    one = runs["one"][name]
    assert [len(batch) for batch in one["batches"]] == [8, 8, 8, 8, 1] * EPOCHS  # each `for` ended with its epoch
    for epoch in range(EPOCHS):  # each sample once
        steps = one["batches"][epoch * EPOCH_STEPS : (epoch + 1) * EPOCH_STEPS]
        assert sorted(sample for batch in steps for sample in batch) == list(range(SAMPLES))
    call = list(SOURCES).index(name) * len(STRATEGIES) + STRATEGIES.index(strategy)
    for rank in runs["two"]:
        assert rank[call]["batches"] == one["batches"]
        for key, weight in rank[call]["weights"].items():
            assert torch.allclose(weight, one["weights"][key], atol=1e-6), (key, weight, one["weights"][key])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process loading, as meant
@pytest.mark.parametrize("saved_at", SAVES)
def test_one_process_resumes_two_processes_checkpoint_at_the_next_sample(runs: dict, saved_at: int) -> None:
    """From mid-epoch, the rest of the epoch then the next; from after the epoch's last batch, the next epoch."""
    resumed = train("torch", "single", runs["folder"], resume=saved_at)
    one = runs["one"]["torch"]
    assert resumed["batches"] == one["batches"][saved_at:]
    for key, weight in resumed["weights"].items():
        assert torch.allclose(weight, one["weights"][key], atol=1e-6)
