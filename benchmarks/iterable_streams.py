"""What reading an iterable dataset as a stream costs each rank: an epoch read at 1 and 2 ranks, and a resume.

    python benchmarks/iterable_streams.py [--samples 100000] [--batch 64]

Every rank reads the whole stream and keeps its share of each global batch (multigpu.data.iterable), so a rank's
reading costs what one process's does, whatever the world size. Measured, for two sources:
- torch: an IterableDataset of `--samples` tensors of 32 floats, made as they are read;
- hf: a Hugging Face streaming dataset over two JSON lines files of `--samples` records {"id", "text"} in all,
  read in the training process and by 2 DataLoader workers per rank (one file each).
For each: the dataset read alone in one process, then one epoch through the loader (global batches of `--batch`,
shuffled within windows of 1,024) at 1 rank and at 2 ranks (2 processes started together, no process group: the
stream needs no communication): wall seconds, the stream's samples per second, CPU seconds per rank (its own
process's, not its workers'). Then the
seconds from a saved position to the first batch after it, 90% of the way through epoch 0 and through epoch 1
(a Hugging Face dataset skips to it in epoch 0; otherwise the records before it are read and dropped).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from multigpu.data.iterable import make_loader
from multigpu.data.stream import StreamLoader


class Tensors(IterableDataset):
    """`n` tensors of 32 floats, each made as it is read; DataLoader workers read every num_workers-th."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return (torch.full((32,), float(i)) for i in range(first, self.n, step))


def hf_stream(folder: str, n: int) -> Any:
    """Two JSON lines files of n records in all, as a Hugging Face streaming dataset (written once)."""
    import datasets

    datasets.disable_progress_bars()
    files = [Path(folder, f"part{f}.jsonl") for f in range(2)]
    if not files[0].exists():
        for f, path in enumerate(files):
            lines = (json.dumps({"id": i, "text": f"record {i} " * 4}) for i in range(f, n, 2))
            path.write_text("\n".join(lines) + "\n")
    return datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", streaming=True)


def dataset(source: str, folder: str, n: int) -> Any:
    return Tensors(n) if source == "torch" else hf_stream(folder, n)


def loader(source: str, folder: str, n: int, workers: int, rank: int, world: int, batch: int) -> StreamLoader:
    return make_loader(  # type: ignore[return-value]
        dataset(source, folder, n),
        num_workers=workers,
        seed=0,
        batch_size=batch // world,
        shuffle=True,
        collate_fn=len,  # the loader's own work, without collating
        rank=rank,
        world_size=world,
        grad_accum_steps=1,
        device=torch.device("cpu"),
    )


def read_epoch(job: dict, rank: int, start: Any, results: Any) -> None:
    """One rank: an epoch of batches through the loader, after every rank is ready."""
    made = loader(job["source"], job["folder"], job["n"], job["workers"], rank, job["world"], job["batch"])
    start.wait()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in zip(range(job["n"] // job["batch"]), made, strict=False):
        pass
    results.put((time.perf_counter() - wall, time.process_time() - cpu))


def epoch_at(job: dict) -> tuple[float, float]:
    """(wall seconds of the slowest rank, CPU seconds of the busiest) for an epoch at job["world"] ranks."""
    forks = multiprocessing.get_context("fork")
    start, results = forks.Barrier(job["world"]), forks.Queue()
    ranks = [forks.Process(target=read_epoch, args=(job, r, start, results)) for r in range(job["world"])]
    for process in ranks:
        process.start()
    measured = [results.get() for _ in ranks]
    for process in ranks:
        process.join()
    return max(m[0] for m in measured), max(m[1] for m in measured)


def read_alone(source: str, folder: str, n: int) -> float:
    """Seconds to read the dataset once in this process, without a loader."""
    data = dataset(source, folder, n)
    started = time.perf_counter()
    for _ in data:
        pass
    return time.perf_counter() - started


def resume_seconds(source: str, folder: str, n: int, workers: int, epoch: int, batch: int) -> float:
    """Seconds from a loader state 90% into `epoch` to the first batch after it."""
    made = loader(source, folder, n, workers, 0, 1, batch)
    window = made.dataset.window
    position = int(n * 0.9) // window * window + 7
    base = {"samples_seen": epoch * n + position, "seed": 0, "shuffle": 1}
    settings = {f"stream_{k}": v for k, v in made.dataset.order_settings.items()}
    state = {"epoch": epoch, "window": position // window, "offset": 7, "position": position, **base, **settings}
    made.load_state_dict(state)
    started = time.perf_counter()
    next(iter(made))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    args = parser.parse_args()
    n = args.samples
    print(f"{n:,} samples, global batches of {args.batch}, {os.cpu_count()} cores, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        for source, workers in (("torch", 0), ("hf", 0), ("hf", 2)):
            if not workers:
                alone = read_alone(source, folder, n)
                print(f"{source} read alone: {alone:.2f} s, {n / alone:,.0f} samples/s", flush=True)
            for world in (1, 2):
                job = dict(source=source, folder=folder, n=n, workers=workers, world=world, batch=args.batch)
                wall, cpu = epoch_at(job)
                print(f"{source}, {workers} workers, {world} rank(s): epoch {wall:.2f} s, {n / wall:,.0f} samples/s "
                      f"of the stream, {cpu:.2f} CPU s per rank", flush=True)  # fmt: skip
            for epoch in (0, 1):
                seconds = resume_seconds(source, folder, n, workers, epoch, args.batch)
                print(f"{source}, {workers} workers: resume 90% into epoch {epoch}: {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main()
