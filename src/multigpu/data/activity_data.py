"""Sensor-activity data, offline: smartwatch IMU recordings from seglearn, or a UCI HAR directory.

Both become fixed-length windows `x` of shape (channels, samples) with integer labels, split into train and
validation by subject, so that no person's recordings are on both sides.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from multigpu.config.flags import check_path
from multigpu.core.errors import UsageError

WATCH_WINDOW, WATCH_STRIDE = 128, 32  # 2.56 s windows at 50 Hz, a new one every 0.64 s
WATCH_VALIDATION_SUBJECTS = (9, 10)  # the last two of ten subjects
HAR_CHANNELS = tuple(f"{kind}_{axis}" for kind in ("body_acc", "body_gyro", "total_acc") for axis in ("x", "y", "z"))
HAR_LABELS = ("WALKING", "WALKING_UPSTAIRS", "WALKING_DOWNSTAIRS", "SITTING", "STANDING", "LAYING")


@dataclass
class ActivityData:
    train: TensorDataset
    validation: TensorDataset
    labels: list[str]
    channels: int
    window: int
    source: str
    mean: list[float]  # per channel: the exported model expects (x - mean) / std
    std: list[float]


def load(data: str) -> ActivityData:
    """`data` is "watch" (seglearn's recordings) or the path of a UCI HAR directory."""
    return load_watch() if data == "watch" else load_uci_har(Path(data))


def watch_file() -> Path:
    spec = importlib.util.find_spec("seglearn")  # locates the package without importing it (and scikit-learn)
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "watch_dataset.npy" if spec else None
    if path is None or not path.is_file():
        raise UsageError(
            "The watch data set ships inside the PyPI package seglearn, which is not installed; "
            "run `pip install --no-deps seglearn` (or pass --data PATH to a UCI HAR directory)."
        )
    return path


def load_watch() -> ActivityData:
    raw = np.load(watch_file(), allow_pickle=True).item()
    split: dict[bool, tuple[list[np.ndarray], list[int]]] = {True: ([], []), False: ([], [])}
    for recording, label, subject in zip(raw["X"], raw["y"], raw["subject"], strict=True):
        windows, labels = split[int(subject) in WATCH_VALIDATION_SUBJECTS]
        for start in range(0, len(recording) - WATCH_WINDOW + 1, WATCH_STRIDE):
            windows.append(recording[start : start + WATCH_WINDOW].T)
            labels.append(int(label))
    (val_x, val_y), (train_x, train_y) = split[True], split[False]
    train_x, val_x, mean, std = _standardise(np.stack(train_x), np.stack(val_x))
    return ActivityData(
        train=_tensors(train_x, train_y),
        validation=_tensors(val_x, val_y),
        labels=list(raw["y_labels"]),
        channels=train_x.shape[1],
        window=WATCH_WINDOW,
        source="seglearn watch_dataset.npy (Burns et al. 2018)",
        mean=mean,
        std=std,
    )


def check(data: str) -> None:
    """The cheap part of `load`: that the data is there and laid out right (before any process starts)."""
    if data == "watch":
        watch_file()
    else:
        har_files(Path(data))


def har_files(root: Path) -> dict[str, list[Path]]:
    """Per split, its 9 signal files then y and subject; refuses a directory that is not in the UCI HAR layout."""
    check_path(
        root, "directory", "--data", "'watch' or a UCI HAR directory", "pass 'watch' or the path of a UCI HAR directory"
    )
    files = {}
    for split in ("train", "test"):
        signals = [root / split / "Inertial Signals" / f"{name}_{split}.txt" for name in HAR_CHANNELS]
        files[split] = [*signals, root / split / f"y_{split}.txt", root / split / f"subject_{split}.txt"]
        missing = [str(path.relative_to(root)) for path in files[split] if not path.is_file()]
        if missing:
            raise UsageError(
                f"--data {root} is not in the UCI HAR layout: {missing[0]} is missing"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; point it at the directory "
                "that holds train/ and test/."
            )
    return files


def load_uci_har(root: Path) -> ActivityData:
    """The UCI HAR layout: {train,test}/Inertial Signals/<channel>_<split>.txt, y_<split>.txt, subject_<split>.txt."""
    parts = {}
    for split, needed in har_files(root).items():
        signals = needed[:-2]
        try:
            x = np.stack([np.loadtxt(path, ndmin=2) for path in signals], axis=1)
            y = np.loadtxt(needed[-2], dtype=np.int64, ndmin=1) - 1  # the files count activities from 1
            subjects = np.loadtxt(needed[-1], dtype=np.int64, ndmin=1)
        except ValueError as error:
            raise UsageError(f"--data {root}: a {split} file is not a table of numbers ({error}).") from None
        if not len(x) == len(y) == len(subjects):
            raise UsageError(
                f"--data {root}: {split} has {len(x)} windows but {len(y)} labels and {len(subjects)} subjects; "
                "the files must have one line per window."
            )
        parts[split] = (x, y, subjects)
    shared = set(parts["train"][2]) & set(parts["test"][2])
    if shared:
        raise UsageError(f"--data {root}: subjects {sorted(shared)} are in both train and test; split by subject.")
    train_x, val_x, mean, std = _standardise(parts["train"][0], parts["test"][0])
    return ActivityData(
        train=_tensors(train_x, parts["train"][1]),
        validation=_tensors(val_x, parts["test"][1]),
        labels=list(HAR_LABELS),
        channels=train_x.shape[1],
        window=train_x.shape[2],
        source=f"UCI HAR at {root}",
        mean=mean,
        std=std,
    )


def _standardise(train: np.ndarray, validation: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[float], list[float]]:
    """Per-channel zero mean and unit variance, with statistics from the training side only."""
    mean = train.mean(axis=(0, 2), keepdims=True)
    std = train.std(axis=(0, 2), keepdims=True) + 1e-8
    return (train - mean) / std, (validation - mean) / std, mean.ravel().tolist(), std.ravel().tolist()


def _tensors(x: np.ndarray, y: np.ndarray | list[int]) -> TensorDataset:
    return TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(np.asarray(y), dtype=torch.long))
